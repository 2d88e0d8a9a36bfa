// The CUDA activation kernels and their launchers, forward (act + quantize + transpose +
// amax) and backward (dact + dbias + quantize + transpose + amax), one pass over the data.
// Layouts and numerics: activation.h; formulas: activation_math.h (shared with the CPU
// reference, bit-identical). Included by one small .cu per act type (activation_<type>.cu,
// LOWBIT_DEFINE_ACT_TYPE_LAUNCH), so that nvcc compiles the types' kernels in parallel
// instead of in one translation unit (the longest of the build); activation.cu dispatches.
// This file holds the launchers (ActVariant, LaunchTiles .. RunActType) and includes the
// kernels: activation_tiled_kernel.cuh (ActTiledKernel, DbiasFinalizeKernel, and their
// design) over activation_device.cuh (constants, ActKernelArgs, device helpers).
// LOWBIT_ACT_VARIANT (benchmark tuning knob, see ActVariant): grid size, cross-tile
// prefetch, tile height and fp32 chunk rows; identical results but for dbias's summation
// order (per tile height; the chunk rows keep it).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "activation/activation.h"
#include "activation/activation_launch.h"
#include "common/cuda_check.h"
#include "common/element.h"
#include "common/reduce.cuh"
#include "activation/half_cvt.cuh"
#include "quantize/fp8_codec.h"
#include "quantize/fp8_cvt.cuh"
#include "activation/activation_device.cuh"
#include "activation/activation_tiled_kernel.cuh"

namespace lowbit {
namespace {

bool Aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// LOWBIT_ACT_VARIANT (a benchmark tuning knob, read at every launch): the grid's cap in
// blocks per SM, whether a tile's last pass prefetches the next tile, and the tile height.
// Unset = 6 (the fp32 plain kernels: kF32DefaultChunkRows*), the fastest on an H100
// (16384 x 16384 bf16, bench/results/activation_variants_*: gelu fwd+q 628.5 / 644.2 /
// 685.9 us for 6 / 5 / 0, dgelu+dbias+q 805.5 / 833.8 / 886.4, swiglu fwd+q 803.6 / 800.5 /
// 844.3, dswiglu+dbias+q 1440 / 1436 /
// 1533). 0 = as many blocks as are resident at once (the kernel's occupancy: one
// persistent round, each block within one tile of the others' count), prefetch, 64-row
// tiles; 1 = 4 per SM, prefetch; 2 = 16, prefetch; 3 = 8 without the prefetch (the
// previous default's schedule); 4 = 8, prefetch; 5 = as 0 with 128-row tiles (128-byte
// colwise column segments, as the standalone quantize kernel's gain from taller tiles;
// half the barriers and transposes' loop overhead per element); 6 = as 0 with 256-row
// tiles (the gated backward: 128). With 8 per SM and 5
// (plain fwd) or 3 (gated bwd) resident, a second round of 3 or 2 blocks per SM runs on
// part of the SM. fp32 input only (other dtypes run 7 / 8 / 9 as 6 / 5 / 6): 7 = as 6 and
// 8 = as 5 with 2 chunk rows per pass (kChunkRows: 8 elements per thread and pass, as
// bf16; 32 loaded bytes per thread and input in flight instead of 16, the fp32 forward
// without y reading 2 of its 3 bytes moved per element where bf16 with y reads 1 of 3),
// 9 = as 6 with 4 (the gated backward: 2; 4 would load 96 values per thread and pass).
// Registers (sm_90a, ptxas -v, gelu): fp32 plain forward 48 / 63 / 78 at 1 / 2 / 4 chunk
// rows (5 / 4 / 3 blocks per SM), plain backward 62 / 80 / 122 (4 / 3 / 2). Every output
// is identical for every variant but dbias, whose fixed summation order depends on the
// tile height only (activation.h).
struct ActVariant {
  int blocks_per_sm = 0;  // 0: the occupancy
  bool prefetch_tiles = true;
  int tile_rows = kTallerTileRows;  // 64, 128 or 256 (unset: variant 6's)
  int f32_chunk_rows = 1;           // fp32 input: 1, 2 or 4 (kChunkRows); others: 1
  bool from_env = false;            // LOWBIT_ACT_VARIANT set (else the defaults below)
};

// Unset, fp32 input of the plain (not gated) kernels takes the fastest chunk rows measured
// for it (H100, 8192 x 16384 f32 gelu, kernel time, bench/results/
// activation_variants_f32_*, the forward's in the .log beside it): the forward 4 (variant
// 9: 310.2 us against 6's 351.4, 7's 326.4), the backward without dx 2 (variant 7: 481.0
// us against 6's 503.2, 9's 493.0).
// Same tile height as 6, so the same bits, dbias included. The gated kernels were not
// measured with fp32 and keep 1.
constexpr int kF32DefaultChunkRowsForward = 4;
constexpr int kF32DefaultChunkRowsBackward = 2;

constexpr char kMaxActVariant = '9';

// False if the value is invalid.
bool ReadActVariant(ActVariant* v) {
  const char* env = std::getenv("LOWBIT_ACT_VARIANT");
  if (env == nullptr || env[0] == '\0') return true;
  if (env[1] != '\0' || env[0] < '0' || env[0] > kMaxActVariant) return false;
  const int i = env[0] - '0';
  v->from_env = true;
  static constexpr int kBlocksPerSm[10] = {0, 4, 16, 8, 8, 0, 0, 0, 0, 0};
  static constexpr int kTileRowsOf[10] = {kShortTileRows, kShortTileRows, kShortTileRows, kShortTileRows,
                                          kShortTileRows, kTallTileRows,  kTallerTileRows, kTallerTileRows,
                                          kTallTileRows,  kTallerTileRows};
  static constexpr int kF32ChunkRows[10] = {1, 1, 1, 1, 1, 1, 1, 2, 2, 4};
  v->blocks_per_sm = kBlocksPerSm[i];
  v->prefetch_tiles = i != 3;
  v->tile_rows = kTileRowsOf[i];
  v->f32_chunk_rows = kF32ChunkRows[i];
  return true;
}

// Resident blocks per SM of ActTiledKernel<Tag, kBackward, kGated, kType, kTileRows,
// kChunkRows, kMayBias> (kThreads threads, static shared memory), asked once per instantiation; 1 if
// the runtime cannot tell.
template <typename Tag, bool kBackward, bool kGated, ActType kType, int kTileRows, int kChunkRows, bool kMayBias>
int ResidentBlocksPerSm() {
  static std::atomic<int> cached{0};
  int n = cached.load(std::memory_order_relaxed);
  if (n == 0) {
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &n, ActTiledKernel<Tag, kBackward, kGated, kType, kTileRows, kChunkRows, kMayBias>, kThreads, 0) !=
            cudaSuccess ||
        n < 1) {
      (void)cudaGetLastError();  // not the next launch's error (cuda_check.h)
      n = 1;
    }
    cached.store(n, std::memory_order_relaxed);
  }
  return n;
}

// The tiled kernel with kTileRows-row tiles, then (dbias) the finalize kernel over its
// tile_rows workspace rows (ActBackwardWorkspaceBytes sizes for 64-row tiles: enough).
template <typename Tag, bool kBackward, bool kGated, ActType kType, int kTileRows, int kChunkRows, bool kMayBias>
Status LaunchTiles(const ActKernelArgs<typename Tag::Storage>& p, const typename Tag::Storage* bias,
                   const ActVariant& variant, GpuStream stream,
                   const char* op) {
  using T = typename Tag::Storage;
  const int64_t tile_rows = (p.rows + kTileRows - 1) / kTileRows;
  const int64_t tile_cols = (p.hidden + kTileCols - 1) / kTileCols;
  if (tile_rows >= (int64_t(1) << 30) || tile_cols >= (int64_t(1) << 30)) {
    return Status::InvalidArgument(std::string(op) + ": x: too many rows or columns for the CUDA kernel");
  }
  const int64_t tiles = tile_rows * tile_cols;
  const int per_sm = variant.blocks_per_sm > 0
                         ? variant.blocks_per_sm
                         : ResidentBlocksPerSm<Tag, kBackward, kGated, kType, kTileRows, kChunkRows, kMayBias>();
  const int blocks = GridStrideBlocks(tiles * kThreads, kThreads, per_sm);
  ActTiledKernel<Tag, kBackward, kGated, kType, kTileRows, kChunkRows, kMayBias><<<blocks, kThreads, 0, stream>>>(p, bias);
  LOWBIT_RETURN_IF_ERROR(LaunchStatus(op));
  if (p.partials == nullptr) return Status::Ok();
  const int64_t finalize_blocks = (p.out_cols + 31) / 32;
  if (finalize_blocks > 0x7FFFFFFF) return Status::InvalidArgument(std::string(op) + ": x: too many columns");
  DbiasFinalizeKernel<Tag><<<unsigned(finalize_blocks), dim3(32, 8), 0, stream>>>(
      p.partials, tile_rows, p.out_cols, static_cast<T*>(p.dbias_out));
  return LaunchStatus(op);
}

// The tall tiles (128 or 256 rows; the gated backward: 128) with kChunkRows chunk rows.
template <typename Tag, bool kBackward, bool kGated, ActType kType, int kChunkRows, bool kMayBias>
Status LaunchTall(const ActKernelArgs<typename Tag::Storage>& p, const typename Tag::Storage* bias,
                  const ActVariant& variant, GpuStream stream,
                  const char* op) {
  if (variant.tile_rows == kTallerTileRows) {
    if constexpr (!(kBackward && kGated)) {
      return LaunchTiles<Tag, kBackward, kGated, kType, kTallerTileRows, kChunkRows, kMayBias>(p, bias, variant, stream, op);
    }
  }
  return LaunchTiles<Tag, kBackward, kGated, kType, kTallTileRows, kChunkRows, kMayBias>(p, bias, variant, stream, op);
}

// The kernel of this tile height and chunk rows, with or without the bias code.
template <typename Tag, bool kBackward, bool kGated, ActType kType, bool kMayBias>
Status LaunchVariant(const ActKernelArgs<typename Tag::Storage>& p, const typename Tag::Storage* bias,
                     const ActVariant& variant, GpuStream stream,
                     const char* op) {
  if constexpr (std::is_same_v<Tag, F32>) {
    // fp32 chunk rows (tall tiles only); the gated backward takes at most 2 (4 would hold
    // 2 x 48 loaded values per thread).
    if (variant.f32_chunk_rows == 4) {
      if constexpr (!(kBackward && kGated)) {
        return LaunchTall<Tag, kBackward, kGated, kType, 4, kMayBias>(p, bias, variant, stream, op);
      }
    }
    if (variant.f32_chunk_rows != 1) return LaunchTall<Tag, kBackward, kGated, kType, 2, kMayBias>(p, bias, variant, stream, op);
  }
  if (variant.tile_rows != kShortTileRows) return LaunchTall<Tag, kBackward, kGated, kType, 1, kMayBias>(p, bias, variant, stream, op);
  return LaunchTiles<Tag, kBackward, kGated, kType, kShortTileRows, 1, kMayBias>(p, bias, variant, stream, op);
}

template <typename Tag, bool kBackward, bool kGated, ActType kType>
Status Launch(const ActArgs& a, void* workspace, GpuStream stream, const char* op) {
  using T = typename Tag::Storage;
  constexpr int kVec = 16 / int(sizeof(T));
  ActKernelArgs<T> p;
  const T* bias = static_cast<const T*>(a.bias);
  p.act = a.params;
  p.rows = a.rows;
  p.hidden = a.hidden;
  p.out_cols = ActOutCols(a, kBackward);
  p.in_cols = kGated ? 2 * a.hidden : a.hidden;
  p.x = static_cast<const T*>(a.x);
  p.dz = static_cast<const T*>(a.dz);
  p.scale = a.scale;
  p.out = static_cast<T*>(a.out);
  p.q_rowwise = a.q_rowwise;
  p.q_colwise = a.q_colwise;
  p.colwise_vec = a.q_colwise != nullptr && Aligned(a.q_colwise, 8) && a.rows % 8 == 0;
  p.amax = reinterpret_cast<uint32_t*>(a.amax);
  p.partials = kBackward && a.dbias != nullptr ? static_cast<float*>(workspace) : nullptr;
  p.dbias_out = a.dbias;
  if (kBackward && a.dbias != nullptr && workspace == nullptr) {
    return Status::Internal(std::string(op) + ": dbias: no workspace");
  }
  p.vector_io = a.hidden % kVec == 0 && Aligned(a.x, 16) && Aligned(a.dz, 16) &&
                Aligned(a.out, 16) && Aligned(a.q_rowwise, 16);
  const bool quantize = a.q_rowwise != nullptr || a.q_colwise != nullptr;
  p.e5m2 = quantize && a.q_dtype == DType::kE5M2;
  ActVariant variant;
  if (!ReadActVariant(&variant)) {
    return Status::InvalidArgument(std::string(op) + ": LOWBIT_ACT_VARIANT: expected 0 to " +
                                   std::string(1, kMaxActVariant) + ", got '" + std::getenv("LOWBIT_ACT_VARIANT") +
                                   "'");
  }
  p.prefetch_tiles = variant.prefetch_tiles;
  if constexpr (std::is_same_v<Tag, F32> && !kGated) {
    if (!variant.from_env) {
      variant.f32_chunk_rows = kBackward ? kF32DefaultChunkRowsBackward : kF32DefaultChunkRowsForward;
    }
  }
  if constexpr (kBackward && kGated) {
    if (bias == nullptr) return LaunchVariant<Tag, kBackward, kGated, kType, false>(p, bias, variant, stream, op);
  }
  return LaunchVariant<Tag, kBackward, kGated, kType, true>(p, bias, variant, stream, op);
}

// One act type's kernels for every dtype, direction and gating.
template <ActType kType>
Status RunActType(const ActArgs& a, void* workspace, GpuStream stream, bool backward, const char* op) {
  return DispatchHighPrecision(a.dtype, op, "x", [&](auto tag) {
    using Tag = decltype(tag);
    if (backward) {
      return a.params.gated ? Launch<Tag, true, true, kType>(a, workspace, stream, op)
                            : Launch<Tag, true, false, kType>(a, workspace, stream, op);
    }
    return a.params.gated ? Launch<Tag, false, true, kType>(a, workspace, stream, op)
                          : Launch<Tag, false, false, kType>(a, workspace, stream, op);
  });
}

}  // namespace
}  // namespace lowbit

// Defines act_cuda::LaunchActType<ActType::TYPE> (activation_launch.h) in the including .cu.
#define LOWBIT_DEFINE_ACT_TYPE_LAUNCH(TYPE)                                                          \
  namespace lowbit::act_cuda {                                                                      \
  template <>                                                                                       \
  Status LaunchActType<ActType::TYPE>(const ActArgs& a, void* workspace, GpuStream stream, bool backward, \
                                      const char* op) {                                             \
    return RunActType<ActType::TYPE>(a, workspace, stream, backward, op);                           \
  }                                                                                                 \
  }
