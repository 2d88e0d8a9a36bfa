// CUDA grouped block quantize (quantize_grouped_block.h): block_tiles.cuh's tile kernels with
// a grouped row tiling. Kernels, in stream order (no host sync: group_sizes stay on the
// device):
//   memsets           the group-bound scale arrays (per-group padding and the unused end
//                     are 0); the ungrouped rowwise scales' padding as the plain launchers.
//   GroupTableKernel  one block, one thread per group: block-wide prefix sums of the clipped
//                     group rows and of each group's tile rows and scale rows (the format's
//                     counts) into a table of G + 1 entries, the tail (rows after the last
//                     group) last.
//   Fp8BlockTileKernel / Mxfp8TileKernel<..., GroupedRowTiles>  the plain kernels; tile row
//                     t belongs to the entry whose tile range holds it (FindGroup of
//                     quantize_grouped.h over the inclusive tile ends: a per-thread cached
//                     range, else a binary search), starts at start_g + k * h, masks rows at
//                     end_g and writes its scales at the group's offsets. The grid walks an
//                     upper bound of tile rows, floor(rows / h) + G + 1; tiles past the last
//                     are skipped. Tail tiles give the ungrouped rowwise copy (MXFP8, 1x128)
//                     and zero codes in the group-bound copies.
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include <string>

#include "common/cuda_check.h"
#include "common/element.h"
#include "quantize/block_tiles.cuh"
#include "quantize/quantize_grouped_block.h"

namespace lowbit {
namespace {

constexpr const char* kOp = "lowbit_quantize_grouped_block";
constexpr int kTableThreads = 1024;  // one group per thread
static_assert(kTableThreads >= kMaxQuantizeGroups, "GroupTableKernel: one thread per group");

// The table: five int32 arrays of E = G + 1 entries (entry G: the tail).
struct GroupTable {
  int32_t* start;      // first row
  int32_t* end;        // end row (exclusive)
  int32_t* tile_end;   // inclusive prefix sum of tile rows (of height h)
  int32_t* scale_off;  // exclusive prefix sum of group-bound scale rows (in blocks)
  int32_t* col2d_off;  // FP8 128x128: exclusive prefix sum of colwise scale columns
  __host__ __device__ static GroupTable At(int32_t* base, int entries) {
    return {base, base + entries, base + 2 * entries, base + 3 * entries, base + 4 * entries};
  }
};

// Per entry: tile rows of height h, group-bound scale rows (MXFP8: roundup(ceil(n/32), 4);
// FP8: ceil(n/128)) and 128x128 colwise scale columns (roundup(ceil(n/128), 4)).
struct Counts {
  int32_t tiles, scale, col2d;
  __device__ Counts operator+(const Counts& o) const { return {tiles + o.tiles, scale + o.scale, col2d + o.col2d}; }
};

__device__ Counts CountsOf(int64_t n, int h, bool mx) {
  const int64_t blocks128 = (n + 127) / 128;
  const int64_t scale = mx ? RoundUpI64(CeilDivI64(n, kMxfp8BlockLen), 4) : blocks128;
  return {int32_t((n + h - 1) / h), int32_t(scale), int32_t(RoundUpI64(blocks128, 4))};
}

struct SumCounts {
  __device__ Counts operator()(const Counts& a, const Counts& b) const { return a + b; }
};

// Group g's rows: with s_h = min(max(sizes[h], 0) * unit, rows), end_g = min(s_0 + ... +
// s_g, rows) and start_g = min(end_g's sum - s_g, rows) (quantize_grouped.h's clipping).
__global__ void __launch_bounds__(kTableThreads)
    GroupTableKernel(const int32_t* __restrict__ sizes, int groups, int64_t unit, int64_t rows, int h, bool mx,
                     int32_t* __restrict__ table) {
  using RowScan = cub::BlockScan<int64_t, kTableThreads>;
  using CountScan = cub::BlockScan<Counts, kTableThreads>;
  __shared__ union {
    typename RowScan::TempStorage rows;
    typename CountScan::TempStorage counts;
  } temp;
  const int g = int(threadIdx.x);
  const int entries = groups + 1;
  const GroupTable t = GroupTable::At(table, entries);
  const int64_t s = g < groups ? min(int64_t(max(sizes[g], 0)) * unit, rows) : 0;
  int64_t sum = 0;
  RowScan(temp.rows).InclusiveSum(s, sum);
  const int64_t end = min(sum, rows), start = min(sum - s, rows);
  const Counts own = g < groups ? CountsOf(end - start, h, mx) : Counts{0, 0, 0};
  __syncthreads();  // temp is reused
  Counts incl;
  CountScan(temp.counts).InclusiveScan(own, incl, SumCounts{});
  if (g >= groups) return;
  t.start[g] = int32_t(start);
  t.end[g] = int32_t(end);
  t.tile_end[g] = incl.tiles;
  t.scale_off[g] = incl.scale - own.scale;
  t.col2d_off[g] = incl.col2d - own.col2d;
  if (g == groups - 1) {  // the tail: rows [end, rows)
    t.start[groups] = int32_t(end);
    t.end[groups] = int32_t(rows);
    t.tile_end[groups] = incl.tiles + int32_t((rows - end + h - 1) / h);
    t.scale_off[groups] = incl.scale;
    t.col2d_off[groups] = incl.col2d;
  }
}

// The grouped row tiling of block_tiles.cuh (see there and the file preamble).
struct GroupedRowTiles {
  static constexpr bool kGrouped = true;
  using Cursor = RowRange;
  GroupTable table;
  int entries = 0;       // G + 1
  int64_t rows = 0;
  int64_t col2d_ld = 0;  // FP8 128x128: row length of the grouped colwise scale matrix

  // floor(rows / h) + G + 1 >= sum over entries of ceil(n / h).
  __host__ __device__ int64_t TileRows(int h) const { return rows / h + entries; }

  __device__ __forceinline__ block_tiles::RowTile Tile(int64_t t, int h, int blocks_per_tile, Cursor& cursor) const {
    block_tiles::RowTile rt;
    const int e = FindGroup(table.tile_end, entries, cursor, int(t));
    if (e < 0) {
      rt.skip = true;
      return rt;
    }
    const int64_t k = t - (e > 0 ? table.tile_end[e - 1] : 0);
    rt.r0 = table.start[e] + k * h;
    rt.r_lim = table.end[e];
    rt.scale_row = table.scale_off[e] + k * blocks_per_tile;
    rt.scale_col2d = table.col2d_off[e] + k;
    rt.tail = e == entries - 1;
    return rt;
  }
};

Status Memset(void* p, size_t bytes, GpuStream stream) {
  if (p == nullptr || bytes == 0) return Status::Ok();
  return CudaStatus(cudaMemsetAsync(p, 0, bytes, stream), kOp, "cudaMemsetAsync");
}

template <typename Tag, typename Fmt>
Status LaunchGroupedTiles(const QuantizeGroupedBlockArgs& a, const GroupedRowTiles& row_tiles, GpuStream stream) {
  const block_tiles::PlainSource<Tag> src{static_cast<const typename Tag::Storage*>(a.x)};
  const bool vec = src.VectorOk(a.cols);
  if (a.kind == GroupedBlockKind::kMxfp8) {
    QuantizeMxfp8Args m;
    m.rows = a.rows, m.cols = a.cols, m.out_dtype = a.out_dtype;
    m.rowwise = a.rowwise, m.rowwise_scale = static_cast<uint8_t*>(a.rowwise_scale);
    m.colwise = a.colwise, m.colwise_scale = static_cast<uint8_t*>(a.colwise_scale);
    return block_tiles::LaunchMxfp8TileKernel<decltype(src), Fmt>(src, vec, row_tiles, m, kOp, stream);
  }
  QuantizeFp8BlockArgs f;
  f.rows = a.rows, f.cols = a.cols, f.out_dtype = a.out_dtype, f.pow2_scales = a.pow2_scales;
  f.tile_2d = a.kind == GroupedBlockKind::kFp8Block128x128;
  f.rowwise = a.rowwise, f.rowwise_scale_inv = static_cast<float*>(a.rowwise_scale);
  f.colwise = a.colwise, f.colwise_scale_inv = static_cast<float*>(a.colwise_scale);
  return f.tile_2d ? block_tiles::LaunchFp8BlockTileKernel<decltype(src), Fmt, true>(src, vec, row_tiles, f, kOp, stream)
                   : block_tiles::LaunchFp8BlockTileKernel<decltype(src), Fmt, false>(src, vec, row_tiles, f, kOp, stream);
}

}  // namespace

Status QuantizeGroupedBlockCuda(const QuantizeGroupedBlockArgs& a, void* workspace, GpuStream stream) {
  LOWBIT_RETURN_IF_ERROR(CheckQuantizeGroupedBlockArgs(a));
  if (workspace == nullptr) return Status::Internal(std::string(kOp) + ": no workspace");
  return DispatchHighPrecision(a.x_dtype, kOp, "x", [&](auto tag) {
    return DispatchFp8(a.out_dtype, kOp, "out", [&](auto fmt) {
      const bool mx = a.kind == GroupedBlockKind::kMxfp8, tile_2d = a.kind == GroupedBlockKind::kFp8Block128x128;
      const int64_t G = a.groups;
      // Scales: the group-bound arrays whole; the ungrouped rowwise ones where padded.
      if (a.colwise_scale != nullptr) {
        const ScaleDims d = mx ? GroupedMxfp8ColScaleDims(a.rows, a.cols, G)
                               : GroupedFp8BlockColScaleDims(a.rows, a.cols, G, tile_2d);
        LOWBIT_RETURN_IF_ERROR(Memset(a.colwise_scale, size_t(d.size()) * (mx ? 1 : sizeof(float)), stream));
      }
      if (tile_2d) {
        const size_t n = size_t(GroupedFp8Block2dRowScaleDims(a.rows, a.cols, G).size()) * sizeof(float);
        LOWBIT_RETURN_IF_ERROR(Memset(a.rowwise_scale, n, stream));
      } else if (mx) {
        LOWBIT_RETURN_IF_ERROR(block_tiles::ZeroMxfp8ScalePadding(static_cast<uint8_t*>(a.rowwise_scale), a.rows,
                                                                  a.cols, false, kOp, stream));
      } else {
        LOWBIT_RETURN_IF_ERROR(block_tiles::ZeroFp8BlockScalePadding(static_cast<float*>(a.rowwise_scale), a.rows,
                                                                     a.cols, false, kOp, stream));
      }

      if (a.rows == 0 || a.cols == 0) return Status::Ok();  // no data; the scales are zeroed

      const int h = mx ? block_tiles::kTileRows : block_tiles::kTile;
      int32_t* table = static_cast<int32_t*>(workspace);
      GroupTableKernel<<<1, kTableThreads, 0, stream>>>(a.group_sizes, int(G), a.rows_per_unit, a.rows, h, mx, table);
      LOWBIT_RETURN_IF_ERROR(LaunchStatus(kOp));

      GroupedRowTiles row_tiles;
      row_tiles.entries = int(G + 1);
      row_tiles.table = GroupTable::At(table, row_tiles.entries);
      row_tiles.rows = a.rows;
      row_tiles.col2d_ld = GroupedFp8BlockColScaleDims(a.rows, a.cols, G, true).dim1;
      return LaunchGroupedTiles<decltype(tag), decltype(fmt)>(a, row_tiles, stream);
    });
  });
}

}  // namespace lowbit
