// CUDA grouped NVFP4 quantize (quantize_grouped_nvfp4.h): quantize_nvfp4_tile.cuh's tile code
// run on each group's rows as on a tensor of its own. Kernels, in stream order (no host sync:
// group_sizes stay on the device):
//   GroupTableKernel  one block, one thread per group: block-wide prefix sums of the clipped
//                     group rows, of each group's 64-row tiles and of its slot sizes (P, B, Q
//                     of the header) into a table of G + 1 entries (entry G: the totals); the
//                     per-group amax slots zeroed.
//   memsets           both scale arrays whole (per-group padding and the unused end are 0).
//   ZeroTailKernel    the rowwise tail rows [end_{G-1}, rows) and the colwise bytes after the
//                     last group (offsets known on the device only).
//   GroupAmaxKernel   CTA = 64 rows of one group x 256 columns (the tile walk below): 16-row
//                     groups down each column (Amax16: plain, and RHT-transformed when the
//                     colwise copy has the RHT), a block max, one atomicMax per CTA and slot.
//   GroupAmaxVecKernel  the same without the colwise RHT (plain max only), 16-byte loads of
//                     V consecutive columns per thread, where cols and x's alignment allow.
//   GroupTileKernel   CTA = one 64 x 64 tile of one group: QuantizeTile on the group's rows,
//                     the outputs pointing at the group's slots, S from its amax slots.
//   FinalizeKernel    global_scale_inv[g] = 1 / S of each group's stored amaxes.
// Tile walk: tile row t belongs to the group whose tile range holds it (FindGroup of
// quantize_grouped.h over the inclusive prefix sums of ceil(n_g / 64)); the grid walks the
// bound floor(rows / 64) + G >= sum_g ceil(n_g / 64) tile rows and skips those past the last.
// amax: unsigned atomicMax on fp32 bit patterns, order-independent, so the bits equal the
// reference's max.
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "common/cuda_check.h"
#include "common/element.h"
#include "common/reduce.cuh"
#include "quantize/quantize_grouped_nvfp4.h"
#include "quantize/quantize_nvfp4_tile.cuh"

namespace lowbit {
namespace {

constexpr const char* kOp = "lowbit_quantize_grouped_nvfp4";
constexpr int kTableThreads = 1024;  // one group per thread
static_assert(kTableThreads >= kMaxQuantizeGroups, "GroupTableKernel: one thread per group");
static_assert(nvfp4_tile::kTile == kGroupedNvfp4TileRows, "the tile walk's tile height is the tile kernel's");
constexpr int kAmaxThreads = 256;    // one column per thread
using nvfp4_tile::kThreads;
using nvfp4_tile::kTile;

// The workspace: six int32 arrays of E = G + 1 entries, then 2G u32 amax slots (the rowwise
// copy's, then the colwise copy's).
struct GroupTable {
  int32_t* start;     // first row
  int32_t* end;       // end row (exclusive)
  int32_t* tile_end;  // inclusive prefix sum of ceil(n / 64)
  int32_t* row_scale;  // P: exclusive prefix sum of roundup(n, 128) (rowwise scale rows)
  int32_t* col_data;   // B: exclusive prefix sum of ceil(n / 2) (colwise bytes per column of x)
  int32_t* col_scale;  // Q: exclusive prefix sum of roundup(ceil(n / 16), 4) (colwise scale columns)
  uint32_t* row_amax;
  uint32_t* col_amax;
  __host__ __device__ static GroupTable At(void* workspace, int groups) {
    int32_t* b = static_cast<int32_t*>(workspace);
    const int e = groups + 1;
    uint32_t* amax = reinterpret_cast<uint32_t*>(b + 6 * e);
    return {b, b + e, b + 2 * e, b + 3 * e, b + 4 * e, b + 5 * e, amax, amax + groups};
  }
};

struct Counts {
  int32_t tiles, row_scale, col_data, col_scale;
  __device__ Counts operator+(const Counts& o) const {
    return {tiles + o.tiles, row_scale + o.row_scale, col_data + o.col_data, col_scale + o.col_scale};
  }
};

struct SumCounts {
  __device__ Counts operator()(const Counts& a, const Counts& b) const { return a + b; }
};

// Group g's rows: with s_h = min(max(sizes[h], 0) * unit, rows), end_g = min(s_0 + ... + s_g,
// rows) and start_g = min(that sum - s_g, rows) (quantize_grouped.h's clipping).
__global__ void __launch_bounds__(kTableThreads)
    GroupTableKernel(const int32_t* __restrict__ sizes, int groups, int64_t unit, int64_t rows, void* workspace) {
  using RowScan = cub::BlockScan<int64_t, kTableThreads>;
  using CountScan = cub::BlockScan<Counts, kTableThreads>;
  __shared__ union {
    typename RowScan::TempStorage rows;
    typename CountScan::TempStorage counts;
  } temp;
  const int g = int(threadIdx.x);
  const GroupTable t = GroupTable::At(workspace, groups);
  const int64_t s = g < groups ? min(int64_t(max(sizes[g], 0)) * unit, rows) : 0;
  int64_t sum = 0;
  RowScan(temp.rows).InclusiveSum(s, sum);
  const int64_t end = min(sum, rows), start = min(sum - s, rows), n = end - start;
  const Counts own = g < groups ? Counts{int32_t((n + kTile - 1) / kTile), int32_t(RoundUpI64(n, 128)),
                                         int32_t((n + 1) / 2), int32_t(RoundUpI64(CeilDivI64(n, 16), 4))}
                                : Counts{0, 0, 0, 0};
  __syncthreads();  // temp is reused
  Counts incl;
  CountScan(temp.counts).InclusiveScan(own, incl, SumCounts{});
  if (g >= groups) return;
  t.start[g] = int32_t(start);
  t.end[g] = int32_t(end);
  t.tile_end[g] = incl.tiles;
  t.row_scale[g] = incl.row_scale - own.row_scale;
  t.col_data[g] = incl.col_data - own.col_data;
  t.col_scale[g] = incl.col_scale - own.col_scale;
  t.row_amax[g] = 0u;
  t.col_amax[g] = 0u;
  if (g == groups - 1) {  // the totals
    t.start[groups] = t.end[groups] = int32_t(end);
    t.tile_end[groups] = incl.tiles;
    t.row_scale[groups] = incl.row_scale;
    t.col_data[groups] = incl.col_data;
    t.col_scale[groups] = incl.col_scale;
  }
}

// Zeros bytes [lo, hi) of p: 16-byte stores where aligned, byte stores at the ends.
__device__ void ZeroRange(uint8_t* p, int64_t lo, int64_t hi, int64_t tid, int64_t threads) {
  if (lo >= hi) return;
  const uintptr_t base = reinterpret_cast<uintptr_t>(p);
  const int64_t a = lo + int64_t((16u - ((base + uintptr_t(lo)) & 15u)) & 15u);  // first aligned byte
  const int64_t b = hi - int64_t((base + uintptr_t(hi)) & 15u);                  // end of the aligned part
  if (a >= b) {
    for (int64_t i = lo + tid; i < hi; i += threads) p[i] = 0;
    return;
  }
  if (tid < a - lo) p[lo + tid] = 0;
  if (tid < hi - b) p[b + tid] = 0;
  uint4* body = reinterpret_cast<uint4*>(p + a);
  for (int64_t i = tid; i < (b - a) / 16; i += threads) body[i] = make_uint4(0u, 0u, 0u, 0u);
}

__global__ void ZeroTailKernel(GroupTable t, int groups, int64_t rows, int64_t cols, uint8_t* rowwise,
                               uint8_t* colwise, int64_t col_bytes) {
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, threads = int64_t(gridDim.x) * blockDim.x;
  const int64_t packed = (cols + 1) / 2;
  if (rowwise != nullptr) ZeroRange(rowwise, int64_t(t.end[groups]) * packed, rows * packed, tid, threads);
  if (colwise != nullptr) ZeroRange(colwise, cols * int64_t(t.col_data[groups]), col_bytes, tid, threads);
}

// The group and first row (relative to the group) of tile row t, or -1 past the last tile.
__device__ __forceinline__ int TileGroup(const GroupTable& t, int groups, int64_t tile_row, int64_t* r0) {
  return GroupedNvfp4TileGroup(t.tile_end, groups, tile_row, r0);
}

// CTA b: tile row b / chunks, columns [(b % chunks) * 256, +256). row: the rowwise copy's slot
// takes max |x|; col: the colwise copy's takes max |x|, or with rht the transformed amax.
template <typename Tag>
__global__ void __launch_bounds__(kAmaxThreads)
    GroupAmaxKernel(const typename Tag::Storage* __restrict__ x, int64_t cols, GroupTable t, int groups,
                    int64_t chunks, bool row, bool col, bool rht, const uint32_t* sign_word) {
  int64_t r0 = 0;
  const int e = TileGroup(t, groups, int64_t(blockIdx.x) / chunks, &r0);
  if (e < 0) return;  // uniform across the CTA
  const int64_t start = t.start[e], n = t.end[e] - start;
  const int64_t c = int64_t(blockIdx.x) % chunks * kAmaxThreads + threadIdx.x;
  const bool col_rht = col && rht;
  const uint32_t sign_bits = col_rht ? *sign_word & 0xFFFFu : 0u;
  uint32_t plain = 0, transformed = 0;
  if (c < cols) {
    const typename Tag::Storage* xg = x + start * cols;
    for (int64_t r = r0; r < r0 + kTile && r < n; r += 16) {
      nvfp4_tile::Amax16<Tag>(xg, n, cols, r, c, col_rht, sign_bits, plain, transformed);
    }
  }
  plain = BlockMaxU32(plain);
  if (col_rht) transformed = BlockMaxU32(transformed);  // uniform condition
  if (threadIdx.x == 0) {
    if (row && plain != 0) atomicMax(t.row_amax + e, plain);
    const uint32_t col_amax = col_rht ? transformed : plain;
    if (col && col_amax != 0) atomicMax(t.col_amax + e, col_amax);
  }
}

// Without the colwise RHT both slots take max |x|: the same walk with 16-byte loads, CTA b
// covering columns [(b % chunks) * 256 V, +256 V), V = 16 / sizeof(element), each thread V
// consecutive columns of every row. Needs cols % V == 0 and x 16-byte aligned (the launcher
// checks; else GroupAmaxKernel runs). A max of |x| bits does not depend on the order.
template <typename Tag>
__global__ void __launch_bounds__(kAmaxThreads)
    GroupAmaxVecKernel(const typename Tag::Storage* __restrict__ x, int64_t cols, GroupTable t, int groups,
                       int64_t chunks, bool row, bool col) {
  using T = typename Tag::Storage;
  constexpr int V = 16 / int(sizeof(T));
  int64_t r0 = 0;
  const int e = TileGroup(t, groups, int64_t(blockIdx.x) / chunks, &r0);
  if (e < 0) return;  // uniform across the CTA
  const int64_t start = t.start[e], n = t.end[e] - start;
  const int64_t c = (int64_t(blockIdx.x) % chunks * kAmaxThreads + threadIdx.x) * V;
  uint32_t amax = 0;
  if (c < cols) {
    const T* xg = x + (start + r0) * cols + c;
    const int64_t count = min(int64_t(kTile), n - r0);
#pragma unroll 4
    for (int64_t r = 0; r < count; ++r) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(xg + r * cols));
      T v[V];
      memcpy(v, &raw, sizeof(raw));
#pragma unroll
      for (int i = 0; i < V; ++i) amax = max(amax, FloatBits(LoadAsFloat(Tag{}, v[i])) & 0x7FFFFFFFu);
    }
  }
  amax = BlockMaxU32(amax);
  if (threadIdx.x == 0 && amax != 0) {
    if (row) atomicMax(t.row_amax + e, amax);
    if (col) atomicMax(t.col_amax + e, amax);
  }
}

struct GroupedOut {
  uint8_t* rowwise = nullptr;  // null: not requested
  uint8_t* rowwise_scale = nullptr;
  int64_t row_scale_pitch = 0;  // roundup(ceil(cols/16), 4)
  uint8_t* colwise = nullptr;   // null: not requested
  uint8_t* colwise_scale = nullptr;
  int64_t col_scale_rows = 0;   // roundup(cols, 128)
};

// CTA b: tile row b / tiles_x, tile column b % tiles_x; the group's rows as a tensor of its own.
template <typename Tag>
__global__ void __launch_bounds__(kThreads)
    GroupTileKernel(const typename Tag::Storage* __restrict__ x, int64_t cols, GroupTable t, int groups,
                    int64_t tiles_x, const uint32_t* random, bool tile_2d, bool rht, const uint32_t* sign_word,
                    GroupedOut out) {
  int64_t r0 = 0;
  const int e = TileGroup(t, groups, int64_t(blockIdx.x) / tiles_x, &r0);
  if (e < 0) return;  // uniform across the CTA
  const int64_t start = t.start[e], n = t.end[e] - start;
  nvfp4_tile::TileParams p;
  p.rows = n;
  p.cols = cols;
  p.random = random != nullptr ? random + start * cols : nullptr;
  p.tile_2d = tile_2d;
  p.rht = rht;
  p.rht_sign_bits = sign_word;
  if (out.rowwise != nullptr) {
    const int64_t packed = (cols + 1) / 2;
    p.row = {out.rowwise + start * packed, out.rowwise_scale + int64_t(t.row_scale[e]) * out.row_scale_pitch,
             out.row_scale_pitch, packed, t.row_amax + e};
  }
  if (out.colwise != nullptr) {
    p.col = {out.colwise + cols * int64_t(t.col_data[e]), out.colwise_scale + out.col_scale_rows * t.col_scale[e],
             RoundUpI64(CeilDivI64(n, 16), 4), (n + 1) / 2, t.col_amax + e};
  }
  nvfp4_tile::QuantizeTile<Tag>(x + start * cols, p, r0, int64_t(blockIdx.x) % tiles_x * kTile);
}

__global__ void FinalizeKernel(GroupTable t, int groups, float* row_out, float* col_out) {
  const int g = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (g >= groups) return;
  if (row_out != nullptr) row_out[g] = ScaleDivRn(1.0f, Nvfp4GlobalScale(t.row_amax[g]));
  if (col_out != nullptr) col_out[g] = ScaleDivRn(1.0f, Nvfp4GlobalScale(t.col_amax[g]));
}

Status Memset(void* p, int64_t bytes, GpuStream stream) {
  if (p == nullptr || bytes <= 0) return Status::Ok();
  return CudaStatus(cudaMemsetAsync(p, 0, size_t(bytes), stream), kOp, "cudaMemsetAsync");
}

Status TooManyTiles(const QuantizeGroupedNvfp4Args& a) {
  return Status::InvalidArgument(std::string(kOp) + ": x: " + std::to_string(a.rows) + " x " +
                                 std::to_string(a.cols) + " has more tiles than a grid holds (2^31 - 1)");
}

template <typename Tag>
Status Launch(const QuantizeGroupedNvfp4Args& a, const GroupTable& t, GpuStream stream) {
  using T = typename Tag::Storage;
  const int G = int(a.groups);
  const bool row = a.rowwise_global_scale_inv != nullptr, col = a.colwise_global_scale_inv != nullptr;
  const auto* x = static_cast<const T*>(a.x);
  const int64_t tile_rows = a.rows / kTile + G;  // >= sum_g ceil(n_g / 64)

  constexpr int64_t kVec = 16 / int64_t(sizeof(T));
  if ((!a.rht || !col) && a.cols % kVec == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    const int64_t chunks = CeilDivI64(a.cols, kAmaxThreads * kVec);
    if (tile_rows * chunks > 2147483647) return TooManyTiles(a);
    GroupAmaxVecKernel<Tag><<<unsigned(tile_rows * chunks), kAmaxThreads, 0, stream>>>(x, a.cols, t, G, chunks,
                                                                                        row, col);
  } else {
    const int64_t chunks = CeilDivI64(a.cols, kAmaxThreads);
    if (tile_rows * chunks > 2147483647) return TooManyTiles(a);
    GroupAmaxKernel<Tag><<<unsigned(tile_rows * chunks), kAmaxThreads, 0, stream>>>(
        x, a.cols, t, G, chunks, row, col, a.rht, a.rht_sign_bits_device);
  }
  LOWBIT_RETURN_IF_ERROR(LaunchStatus(kOp));

  GroupedOut out;
  if (row) {
    out.rowwise = a.rowwise;
    out.rowwise_scale = a.rowwise_scale;
    out.row_scale_pitch = GroupedNvfp4RowScaleDims(a.rows, a.cols, a.groups).dim1;
  }
  if (col) {
    out.colwise = a.colwise;
    out.colwise_scale = a.colwise_scale;
    out.col_scale_rows = RoundUpI64(a.cols, 128);
  }
  const int64_t tiles_x = CeilDivI64(a.cols, kTile);
  if (tile_rows * tiles_x > 2147483647) return TooManyTiles(a);
  GroupTileKernel<Tag><<<unsigned(tile_rows * tiles_x), kThreads, 0, stream>>>(
      x, a.cols, t, G, tiles_x, a.random, a.tile_2d, a.rht && col, a.rht_sign_bits_device, out);
  return LaunchStatus(kOp);
}

}  // namespace

Status QuantizeGroupedNvfp4Cuda(const QuantizeGroupedNvfp4Args& a, void* workspace, GpuStream stream) {
  LOWBIT_RETURN_IF_ERROR(CheckQuantizeGroupedNvfp4Args(a));
  if (workspace == nullptr) return Status::Internal(std::string(kOp) + ": no workspace");
  const bool row = a.rowwise_global_scale_inv != nullptr, col = a.colwise_global_scale_inv != nullptr;
  if (a.rht && col && a.rht_sign_bits_device == nullptr) {
    return Status::InvalidArgument(std::string(kOp) + ": rht_sign_bits: the CUDA launcher reads "
                                   "the sign word from device memory (rht_sign_bits_device)");
  }
  const int G = int(a.groups);
  const GroupTable t = GroupTable::At(workspace, G);
  const bool has_data = a.rows * a.cols != 0;
  if (!IsHighPrecision(a.x_dtype)) return Status::InvalidArgument(std::string(kOp) + ": x: expected f32, f16 or bf16");
  if (has_data) {
    if (row) LOWBIT_RETURN_IF_ERROR(Memset(a.rowwise_scale, GroupedNvfp4RowScaleDims(a.rows, a.cols, a.groups).size(), stream));
    if (col) LOWBIT_RETURN_IF_ERROR(Memset(a.colwise_scale, GroupedNvfp4ColScaleBytes(a.rows, a.cols, a.groups), stream));
  }
  GroupTableKernel<<<1, kTableThreads, 0, stream>>>(a.group_sizes, G, a.rows_per_unit, a.rows, workspace);
  LOWBIT_RETURN_IF_ERROR(LaunchStatus(kOp));
  if (has_data) {
    const int64_t packed = CeilDivI64(a.cols, 2);
    const int64_t col_bytes = GroupedNvfp4ColBytes(a.rows, a.cols, a.groups);
    const int64_t most = (a.rows * packed > col_bytes ? a.rows * packed : col_bytes) / 16 + 32;
    ZeroTailKernel<<<GridStrideBlocks(most, 256, 4), 256, 0, stream>>>(
        t, G, a.rows, a.cols, row ? a.rowwise : nullptr, col ? a.colwise : nullptr, col_bytes);
    LOWBIT_RETURN_IF_ERROR(LaunchStatus(kOp));
    LOWBIT_RETURN_IF_ERROR(
        DispatchHighPrecision(a.x_dtype, kOp, "x", [&](auto tag) { return Launch<decltype(tag)>(a, t, stream); }));
  }
  FinalizeKernel<<<unsigned((G + 255) / 256), 256, 0, stream>>>(t, G, row ? a.rowwise_global_scale_inv : nullptr,
                                                                 col ? a.colwise_global_scale_inv : nullptr);
  return LaunchStatus(kOp);
}

}  // namespace lowbit
