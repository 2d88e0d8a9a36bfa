// The tiled FP8 per-tensor cast-transpose kernel of quantize_fp8.cu, shared with the grouped
// quantizer (quantize_grouped.cu): one resident wave of blocks loops over tiles of 64, 128
// or 256 rows x 128 columns, staged through shared memory with cp.async; each tile is
// encoded (amax, rowwise codes) and, one step later, transposed (colwise codes) and summed
// (dbias). Layouts, numerics and the tile variants: quantize.h; the kernel's pipeline and
// shared-memory swizzles are described where they are defined (quantize_tiled_kernel.cuh,
// quantize_tiled_tile.cuh).
//
// `Groups` is how rows get their scale and where their amax goes:
//   OneTensor  one scale (scale_ptr) for all rows, one amax (quantize_fp8.cu);
//   GroupTable (quantize_grouped.cu) a per-group table kept in SmemBytes() bytes of shared
//              memory after the tiles: Load (before the loop), GroupOf / ScaleOf / AddAmax
//              per encoded row, Flush (after the loop).
// With OneTensor every `if constexpr (Groups::kGrouped)` branch drops out, so the per-tensor
// kernels are the code they were before the grouping hooks existed.
//
// `Place` is where the copies' rows go: DensePlace the layouts of quantize.h (every caller
// but one), SlicedPlace an Fp8CopyPlacement (lowbit_dense_backward_fp8).
//
// This header includes the kernel's pieces and keeps its launchers (TileVariant,
// ParseTileVariant, LaunchTiled, LaunchTiledVariant): quantize_tiled_policies.cuh (OneTensor
// and the Places), quantize_tiled_tile.cuh (TileShape, swizzles, loads, stores, tile order)
// and quantize_tiled_kernel.cuh (QuantizeTiledKernel and its pipeline).
//
// Private to those two .cu files: everything is in an anonymous namespace, as it was when
// it lived in quantize_fp8.cu (each file instantiates its own kernels).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/cp_async.cuh"
#include "common/cuda_check.h"
#include "common/element.h"
#include "common/fast_div.h"
#include "common/reduce.cuh"
#include "quantize/fp8_codec.h"
#include "quantize/fp8_cvt.cuh"
#include "quantize/quantize.h"
#include "quantize/quantize_tiled_kernel.cuh"
#include "quantize/quantize_tiled_policies.cuh"
#include "quantize/quantize_tiled_tile.cuh"

namespace lowbit {
namespace {

// The tiled kernel's tuning knobs (quantize.h, LOWBIT_QUANTIZE_TILE_VARIANT).
struct TileVariant {
  int rows = 256;   // tile height: 64, 128 or 256 (the default; 4 threads per tile row)
  int stages = 2;   // input stages: 2 or 3
  int band = 0;     // 0: row-major tile order; else bands of `band` tile rows
};

Status ParseTileVariant(const char* op, TileVariant* v) {
  const char* env = std::getenv(kTileVariantEnv);
  if (env == nullptr || *env == '\0') return Status::Ok();
  int rows = 0, stages = 0, band = 0, used = 0;
  const int n = std::sscanf(env, "r%ds%d%n", &rows, &stages, &used);
  bool ok = n == 2 && ((rows == 64 && (stages == 2 || stages == 3)) || ((rows == 128 || rows == 256) && stages == 2));
  if (ok && env[used] == 'b') {
    int more = 0;
    ok = std::sscanf(env + used, "b%d%n", &band, &more) == 1 && band >= 1 && band <= 4096;
    used += more;
  }
  ok = ok && env[used] == '\0';
  if (!ok) {
    return Status::InvalidArgument(std::string(op) + ": " + kTileVariantEnv + "=\"" + env +
                                   "\": expected r64s2, r64s3, r128s2 or r256s2, optionally followed by b<1..4096>");
  }
  v->rows = rows;
  v->stages = stages;
  v->band = band;
  return Status::Ok();
}

template <typename Tag, typename Fmt, bool kVectorIO, int kRows, int kStages, typename Groups, typename Place>
Status LaunchTiled(const char* op, const QuantizeFp8Args& a, float* partials, const Groups& groups,
                   const Place& place, const TileVariant& v, GpuStream stream, int* tile_rows) {
  *tile_rows = kRows;
  using T = typename Tag::Storage;
  using Shape = TileShape<T, kRows, kStages>;
  auto kernel = QuantizeTiledKernel<Tag, Fmt, kVectorIO, kRows, kStages, Groups, Place>;
  const int smem_bytes = Shape::kSmemBytes + groups.SmemBytes();
  // The grouped kernels' size depends on the group count: raise-only (cuda_check.h).
  LOWBIT_RETURN_IF_ERROR(RaiseDynamicSmemLimit(kernel, smem_bytes, op));
  // One resident wave: every block loops over tiles, so blocks beyond what fits would
  // only start late. The occupancy query is host-side arithmetic (no device sync).
  int per_sm = 0;
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, Shape::kThreads,
                                                                                  smem_bytes),
                                    op, "cudaOccupancyMaxActiveBlocksPerMultiprocessor"));
  const int64_t tiles = (a.rows + kRows - 1) / kRows * ((a.cols + kTileCols - 1) / kTileCols);
  const int blocks = GridStrideBlocks(tiles * Shape::kThreads, Shape::kThreads, per_sm > 0 ? per_sm : 1);
  kernel<<<blocks, Shape::kThreads, smem_bytes, stream>>>(
      static_cast<const T*>(a.x), a.rows, a.cols, a.scale, a.rowwise, a.colwise,
      reinterpret_cast<uint32_t*>(a.amax), partials, uint32_t(v.band), groups, place);
  return LaunchStatus(op);
}

// Picks the instantiation for the variant. f32 x always takes 64-row tiles and two stages
// (its 32 KB stages would leave one block per SM otherwise); where this device grants a
// block less shared memory than the variant needs (r256s2: 208 KB), 256 rows fall back to
// 128 and anything else to r64s2.
template <typename Tag, typename Fmt, bool kVectorIO, typename Groups, typename Place = DensePlace>
Status LaunchTiledVariant(const char* op, const QuantizeFp8Args& a, float* partials, const Groups& groups,
                          const TileVariant& v, GpuStream stream, int* tile_rows, const Place& place = Place{}) {
  using T = typename Tag::Storage;
  if constexpr (sizeof(T) == 4) {
    return LaunchTiled<Tag, Fmt, kVectorIO, 64, 2>(op, a, partials, groups, place, v, stream, tile_rows);
  } else {
    int device = 0, optin = 0;
    LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), op, "cudaGetDevice"));
    LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                                      op, "cudaDeviceGetAttribute"));
    if (v.rows == 256 && TileShape<T, 256, 2>::kSmemBytes + groups.SmemBytes() <= optin) {
      return LaunchTiled<Tag, Fmt, kVectorIO, 256, 2>(op, a, partials, groups, place, v, stream, tile_rows);
    }
    if (v.rows >= 128 && TileShape<T, 128, 2>::kSmemBytes + groups.SmemBytes() <= optin) {
      return LaunchTiled<Tag, Fmt, kVectorIO, 128, 2>(op, a, partials, groups, place, v, stream, tile_rows);
    }
    if (v.rows == 64 && v.stages == 3 && TileShape<T, 64, 3>::kSmemBytes + groups.SmemBytes() <= optin) {
      return LaunchTiled<Tag, Fmt, kVectorIO, 64, 3>(op, a, partials, groups, place, v, stream, tile_rows);
    }
    return LaunchTiled<Tag, Fmt, kVectorIO, 64, 2>(op, a, partials, groups, place, v, stream, tile_rows);
  }
}
}  // namespace
}  // namespace lowbit
