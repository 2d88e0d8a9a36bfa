// CUDA grouped FP8 quantize (quantize_grouped.h): the per-tensor tiled cast-transpose kernel
// of quantize_tiled.cuh with a per-group scale table instead of one scale. Kernels, in
// stream order (no host sync: group_sizes stay on the device):
//   GroupEndsKernel   one block: the groups' clipped end rows (a block-wide prefix sum of
//                     the sizes) into the workspace; amax zeroed; for delayed scaling (or
//                     an empty x) scale_out and scale_inv, which are known up front.
//   GroupAmaxKernel   current scaling only: each block reads a contiguous range of rows
//                     (16-byte chunks where x is aligned and cols % 8|4 == 0, else
//                     elements), keeps a running max per thread while its group stays the
//                     same, and folds it into a shared per-group amax when the group
//                     changes; then one global atomicMax per touched group.
//   QuantizeTiledKernel<..., GroupTable>  the per-tensor kernel (quantize_tiled_kernel.cuh): each
//                     block loads the group table (ends, scales, amax slots: 12 bytes per
//                     group) into shared memory after its tiles; every encoded row finds
//                     its group (a per-thread cached row range, else a binary search over
//                     the ends) and is encoded with that group's scale; padding rows get
//                     zero codes. Delayed scaling also collects the per-group amax there
//                     (8 lanes of a row reduce, one shared atomicMax, then one global
//                     atomicMax per group per block). Current scaling computes each
//                     group's scale from the amax pass's result (block 0 writes them out).
// amax: unsigned atomicMax on fp32 bit patterns, order-independent, so deterministic and
// equal to the reference's max.
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include <climits>
#include <string>

#include "common/cuda_check.h"
#include "common/element.h"
#include "quantize/fp8_codec.h"
#include "quantize/quantize.h"
#include "quantize/quantize_grouped.h"
#include "quantize/quantize_tiled.cuh"
#include "scale/scale.h"

namespace lowbit {
namespace {

constexpr const char* kOp = "lowbit_quantize_grouped_fp8";
constexpr int kEndsThreads = 1024;  // one group per thread
static_assert(kEndsThreads >= kMaxQuantizeGroups, "GroupEndsKernel: one thread per group");
constexpr int kAmaxThreads = 512;

// ends[g] = min(s_0 + ... + s_g, rows), s_h = max(sizes[h], 0) * unit clipped to rows first
// (which leaves the clipped sums unchanged and keeps them far from overflow).
__global__ void __launch_bounds__(kEndsThreads)
    GroupEndsKernel(const int32_t* __restrict__ sizes, int groups, int64_t unit, int64_t rows,
                    int32_t* __restrict__ ends, float* __restrict__ amax, const float* __restrict__ scale_in,
                    bool write_unit_scales, float* __restrict__ scale_out, float* __restrict__ scale_inv) {
  using Scan = cub::BlockScan<int64_t, kEndsThreads>;
  __shared__ typename Scan::TempStorage temp;
  const int g = int(threadIdx.x);
  int64_t s = g < groups ? min(int64_t(max(sizes[g], 0)) * unit, rows) : 0;
  Scan(temp).InclusiveSum(s, s);
  if (g >= groups) return;
  ends[g] = int32_t(min(s, rows));
  amax[g] = 0.0f;
  if (scale_in != nullptr) {  // delayed scaling
    scale_out[g] = scale_in[g];
    scale_inv[g] = ScaleDivRn(1.0f, scale_in[g]);
  } else if (write_unit_scales) {  // current scaling of an empty x: every amax is 0 -> scale 1
    scale_out[g] = 1.0f;
    scale_inv[g] = 1.0f;
  }
}

// The grouped `Groups` of the tiled kernel (quantize_tiled.cuh). Shared-memory table after
// the tiles: int32 ends[G] | f32 scales[G] | u32 amax bits[G].
struct GroupTable {
  static constexpr bool kGrouped = true;
  using Cursor = RowRange;
  const int32_t* ends = nullptr;     // G end rows (GroupEndsKernel)
  const float* scale = nullptr;      // delayed scaling: G scales; null: current scaling
  const float* amax_in = nullptr;    // current scaling: the amax pass's result
  float* amax_out = nullptr;         // delayed scaling: zeroed, accumulated here; else null
  float* scale_out = nullptr;        // current scaling: written by block 0
  float* scale_inv = nullptr;
  int groups = 0;
  float fp8_max = 0.0f;
  bool pow2 = false;

  int SmemBytes() const { return groups * 12; }

  __device__ __forceinline__ void Load(uint8_t* table) const {
    int32_t* ends_s = reinterpret_cast<int32_t*>(table);
    float* scale_s = reinterpret_cast<float*>(ends_s + groups);
    uint32_t* amax_s = reinterpret_cast<uint32_t*>(scale_s + groups);
    for (int g = int(threadIdx.x); g < groups; g += int(blockDim.x)) {
      ends_s[g] = ends[g];
      const float s = scale != nullptr ? scale[g] : CurrentScale(amax_in[g], fp8_max, pow2);
      scale_s[g] = s;
      amax_s[g] = 0u;
      if (scale == nullptr && blockIdx.x == 0) {
        scale_out[g] = s;
        scale_inv[g] = ScaleDivRn(1.0f, s);
      }
    }
  }
  __device__ __forceinline__ int GroupOf(const uint8_t* table, RowRange& cursor, int64_t row) const {
    return FindGroup(reinterpret_cast<const int32_t*>(table), groups, cursor, int(min(row, int64_t(INT_MAX))));
  }
  __device__ __forceinline__ float ScaleOf(const uint8_t* table, int group) const {
    return group < 0 ? 1.0f : reinterpret_cast<const float*>(table + groups * 4)[group];
  }
  // Called by every lane of the warp: the 8 lanes of a tile row (consecutive threads) hold
  // its 128 columns, so they reduce first and one of them updates the group's slot.
  __device__ __forceinline__ void AddAmax(uint8_t* table, int group, uint32_t chunk_max) const {
    if (amax_out == nullptr) return;  // current scaling: the amax pass has it
    chunk_max = max(chunk_max, __shfl_xor_sync(0xFFFFFFFFu, chunk_max, 1));
    chunk_max = max(chunk_max, __shfl_xor_sync(0xFFFFFFFFu, chunk_max, 2));
    chunk_max = max(chunk_max, __shfl_xor_sync(0xFFFFFFFFu, chunk_max, 4));
    if ((threadIdx.x & 7) == 0 && group >= 0 && chunk_max != 0) {
      atomicMax(reinterpret_cast<uint32_t*>(table + groups * 8) + group, chunk_max);
    }
  }
  __device__ __forceinline__ void Flush(uint8_t* table) const {
    if (amax_out == nullptr) return;
    __syncthreads();
    const uint32_t* amax_s = reinterpret_cast<const uint32_t*>(table + groups * 8);
    for (int g = int(threadIdx.x); g < groups; g += int(blockDim.x)) {
      if (amax_s[g] != 0u) atomicMax(reinterpret_cast<uint32_t*>(amax_out) + g, amax_s[g]);
    }
  }
};

// Block b reads rows [b * rows_per_block, ...) as `chunks_per_row` chunks of kVec elements
// per row; thread t takes chunks t, t + blockDim, ... of the range, tracking (row, chunk)
// incrementally (no division per chunk).
template <typename Tag, int kVec>
__global__ void __launch_bounds__(kAmaxThreads)
    GroupAmaxKernel(const typename Tag::Storage* __restrict__ x, int64_t rows, int64_t chunks_per_row,
                    const int32_t* __restrict__ ends, int groups, int64_t rows_per_block, float* __restrict__ amax) {
  using T = typename Tag::Storage;
  extern __shared__ __align__(16) uint8_t amax_smem[];
  int32_t* ends_s = reinterpret_cast<int32_t*>(amax_smem);
  uint32_t* amax_s = reinterpret_cast<uint32_t*>(ends_s + groups);
  for (int g = int(threadIdx.x); g < groups; g += int(blockDim.x)) {
    ends_s[g] = ends[g];
    amax_s[g] = 0u;
  }
  __syncthreads();

  const int64_t r_begin = int64_t(blockIdx.x) * rows_per_block;
  const int64_t r_end = min(rows, r_begin + rows_per_block);
  const int64_t n = r_end > r_begin ? (r_end - r_begin) * chunks_per_row : 0;
  const int64_t step_rows = int64_t(blockDim.x) / chunks_per_row, step_chunks = int64_t(blockDim.x) % chunks_per_row;
  int64_t row = r_begin + int64_t(threadIdx.x) / chunks_per_row, chunk = int64_t(threadIdx.x) % chunks_per_row;
  RowRange cursor;
  int group = -1;
  uint32_t run = 0;  // max |x| bits of this thread's chunks in `group`
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int g = FindGroup(ends_s, groups, cursor, int(row));
    if (g != group) {
      if (group >= 0 && run != 0) atomicMax(amax_s + group, run);
      group = g;
      run = 0;
    }
    uint32_t m = 0;
    if constexpr (kVec > 1) {
      const uint4 packed = __ldg(reinterpret_cast<const uint4*>(x) + row * chunks_per_row + chunk);
      T vals[kVec];
      memcpy(vals, &packed, sizeof(packed));
#pragma unroll
      for (int e = 0; e < kVec; ++e) m = max(m, AbsBitsOf(LoadAsFloat(Tag{}, vals[e])));
    } else {
      m = AbsBitsOf(LoadAsFloat(Tag{}, x[row * chunks_per_row + chunk]));
    }
    run = max(run, m);
    row += step_rows;
    chunk += step_chunks;
    if (chunk >= chunks_per_row) {
      chunk -= chunks_per_row;
      ++row;
    }
  }
  if (group >= 0 && run != 0) atomicMax(amax_s + group, run);
  __syncthreads();
  for (int g = int(threadIdx.x); g < groups; g += int(blockDim.x)) {
    if (amax_s[g] != 0u) atomicMax(reinterpret_cast<uint32_t*>(amax) + g, amax_s[g]);
  }
}

template <typename Tag>
Status LaunchGroupAmax(const QuantizeGroupedFp8Args& a, const int32_t* ends, GpuStream stream) {
  using T = typename Tag::Storage;
  constexpr int kVec = 16 / int(sizeof(T));
  const bool vec = reinterpret_cast<uintptr_t>(a.x) % 16 == 0 && a.cols % kVec == 0;
  const int64_t chunks_per_row = vec ? a.cols / kVec : a.cols;
  // Contiguous row ranges, about 4 blocks per SM (fewer for short x).
  const int blocks = GridStrideBlocks(a.rows * chunks_per_row, kAmaxThreads, 4);
  const int64_t rows_per_block = (a.rows + blocks - 1) / blocks;
  const int grid = int((a.rows + rows_per_block - 1) / rows_per_block);
  const size_t smem = size_t(a.groups) * 8;
  const T* x = static_cast<const T*>(a.x);
  if (vec) {
    GroupAmaxKernel<Tag, kVec><<<grid, kAmaxThreads, smem, stream>>>(x, a.rows, chunks_per_row, ends, int(a.groups),
                                                                     rows_per_block, a.amax);
  } else {
    GroupAmaxKernel<Tag, 1><<<grid, kAmaxThreads, smem, stream>>>(x, a.rows, chunks_per_row, ends, int(a.groups),
                                                                  rows_per_block, a.amax);
  }
  return LaunchStatus(kOp);
}

template <typename Tag, typename Fmt>
Status LaunchGrouped(const QuantizeGroupedFp8Args& a, const int32_t* ends, GpuStream stream) {
  using T = typename Tag::Storage;
  constexpr int kVec = 16 / int(sizeof(T));
  if (a.current_scaling) LOWBIT_RETURN_IF_ERROR(LaunchGroupAmax<Tag>(a, ends, stream));

  GroupTable table;
  table.ends = ends;
  table.scale = a.current_scaling ? nullptr : a.scale;
  table.amax_in = a.current_scaling ? a.amax : nullptr;
  table.amax_out = a.current_scaling ? nullptr : a.amax;
  table.scale_out = a.scale_out;
  table.scale_inv = a.scale_inv;
  table.groups = int(a.groups);
  table.fp8_max = Fmt::kMax;
  table.pow2 = a.use_power_2_scales;

  QuantizeFp8Args tiles;  // the tiled kernel's view: no scale pointer, no amax, no dbias
  tiles.x = a.x;
  tiles.x_dtype = a.x_dtype;
  tiles.rows = a.rows;
  tiles.cols = a.cols;
  tiles.out_dtype = a.out_dtype;
  tiles.rowwise = a.rowwise;
  tiles.colwise = a.colwise;

  TileVariant variant;
  LOWBIT_RETURN_IF_ERROR(ParseTileVariant(kOp, &variant));
  const bool vec_io = reinterpret_cast<uintptr_t>(a.x) % 16 == 0 && a.cols % kVec == 0;
  int tile_height = 0;
  return vec_io ? LaunchTiledVariant<Tag, Fmt, true>(kOp, tiles, nullptr, table, variant, stream, &tile_height)
                : LaunchTiledVariant<Tag, Fmt, false>(kOp, tiles, nullptr, table, variant, stream, &tile_height);
}

}  // namespace

Status QuantizeGroupedFp8Cuda(const QuantizeGroupedFp8Args& a, void* workspace, GpuStream stream) {
  LOWBIT_RETURN_IF_ERROR(CheckQuantizeGroupedFp8Args(a));
  if (workspace == nullptr) return Status::Internal(std::string(kOp) + ": no workspace");
  return DispatchHighPrecision(a.x_dtype, kOp, "x", [&](auto tag) {
    return DispatchFp8(a.out_dtype, kOp, "out", [&](auto fmt) {
      using Tag = decltype(tag);
      using Fmt = decltype(fmt);
      int32_t* ends = static_cast<int32_t*>(workspace);
      const bool empty = a.rows == 0 || a.cols == 0;
      GroupEndsKernel<<<1, kEndsThreads, 0, stream>>>(a.group_sizes, int(a.groups), a.rows_per_unit, a.rows, ends,
                                                      a.amax, a.current_scaling ? nullptr : a.scale,
                                                      a.current_scaling && empty, a.scale_out, a.scale_inv);
      LOWBIT_RETURN_IF_ERROR(LaunchStatus(kOp));
      if (empty) return Status::Ok();
      return LaunchGrouped<Tag, Fmt>(a, ends, stream);
    });
  });
}

}  // namespace lowbit
