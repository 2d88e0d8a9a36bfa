// CUDA FP8 per-tensor quantize (fused cast + transpose + amax + dbias) and dequantize.
// Numerics and layouts: quantize.h. Kernels:
//   QuantizeRowwiseKernel  rowwise only, no dbias: a flat grid-stride pass, 16-byte loads
//                          (one or two chunks per thread step: LOWBIT_QUANTIZE_ROWWISE_KERNEL,
//                          which can also send rowwise-only work to the tiled kernel).
//   QuantizeTiledKernel    (quantize_tiled_kernel.cuh via quantize_tiled.cuh, shared with the
//                          grouped quantizer; here with Groups = OneTensor) anything with
//                          colwise or dbias: one resident wave of blocks loops
//                          over tiles of 64, 128 or 256 rows x 128 columns (4 threads per tile
//                          row), with one __syncthreads per tile: tile i + 1 (or i + 2) is
//                          copied into shared memory (cp.async) while tile i is encoded
//                          (rowwise 16-byte stores, codes kept in shared memory) and tile
//                          i - 1's codes are transposed (8 x 4 bytes per thread, 8-byte
//                          colwise stores; 8 lanes cover 64 contiguous bytes of a colwise
//                          row) and its dbias row-group sums added into a workspace row.
//                          Shared-memory layouts are XOR-swizzled: no bank conflicts. Tile
//                          height, stages and tile order: LOWBIT_QUANTIZE_TILE_VARIANT.
//   DbiasFinalizeKernel    (dbias_finalize.cuh) sums the workspace rows in a fixed order
//                          (deterministic; a NaN sum made the canonical NaN).
//   DequantizeKernel       flat, 8 codes per thread step.
// Encoding: sm_89+ converts two values per cvt.rn.satfinite instruction, bit-identical to
// the formats.h codecs except for NaN; chunks that may hold a NaN product use the codecs
// (EncodeChunk, EncodeStepFromShared), whose NaN sign comes from MulNanDefined (a GPU multiply returns the
// sign-less 0x7FFFFFFF for any NaN), so the result equals the CPU reference bit for bit.
// amax: each block reduces |x| bit patterns, then one unsigned atomicMax on the zeroed
// result (order-independent, so deterministic). Partial tiles are zero-filled in shared
// memory; unaligned x takes element loads, stores narrow to what their address allows;
// nothing is read or written outside the tensors.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/cuda_check.h"
#include "common/element.h"
#include "common/reduce.cuh"
#include "quantize/dbias_finalize.cuh"
#include "quantize/fp8_codec.h"
#include "quantize/fp8_cvt.cuh"
#include "quantize/quantize.h"
#include "quantize/quantize_tiled.cuh"  // the tiled kernel (shared with quantize_grouped.cu)

namespace lowbit {
namespace {

constexpr const char* kQuantizeOp = "lowbit_quantize_fp8";
constexpr const char* kDequantizeOp = "lowbit_dequantize_fp8";
constexpr int kThreads = 256;  // flat kernels

// kChunks consecutive 16-byte chunks (kVec elements each) per thread and step; kVec = 1:
// element loads only.
template <typename Tag, typename Fmt, int kVec, int kChunks>
__global__ void __launch_bounds__(kThreads)
    QuantizeRowwiseKernel(const typename Tag::Storage* __restrict__ x, int64_t n,
                          const float* __restrict__ scale_ptr, uint8_t* __restrict__ rowwise,
                          uint32_t* __restrict__ amax) {
  using T = typename Tag::Storage;
  constexpr int kN = kVec * kChunks;  // elements per step
  const float scale = __ldg(scale_ptr);
  const bool scale_ok = ScaleKeepsFinite(scale);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t best = 0;
  int64_t done = 0;
  if constexpr (kVec > 1) {
    const int64_t steps = n / kN;
    const uint4* vec = reinterpret_cast<const uint4*>(x);
    for (int64_t i = first; i < steps; i += stride) {
      uint4 packed[kChunks];
#pragma unroll
      for (int c = 0; c < kChunks; ++c) packed[c] = __ldg(vec + i * kChunks + c);
      T vals[kN];
      memcpy(vals, packed, sizeof(packed));
      float v[kN];
      uint32_t chunk_max = 0;
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        v[j] = LoadAsFloat(Tag{}, vals[j]);
        chunk_max = max(chunk_max, AbsBitsOf(v[j]));
      }
      best = max(best, chunk_max);
      uint32_t words[kN / 4];
      EncodeChunk(Fmt{}, v, scale, scale_ok && chunk_max <= 0x7F800000u, words);
      StoreCodes<kN>(rowwise + i * kN, words);
    }
    done = steps * kN;
  }
  for (int64_t i = done + first; i < n; i += stride) {
    const float v = LoadAsFloat(Tag{}, x[i]);
    best = max(best, AbsBitsOf(v));
    rowwise[i] = EncodeScaled(Fmt{}, v, scale);
  }
  best = BlockMaxU32(best);
  if (threadIdx.x == 0 && best != 0) atomicMax(amax, best);
}

// LOWBIT_QUANTIZE_ROWWISE_KERNEL (quantize.h): 16-byte chunks per thread step of the flat
// rowwise kernel, or 0 for the tiled kernel.
Status ParseRowwiseKernel(int* chunks) {
  const char* env = std::getenv(kQuantizeRowwiseKernelEnv);
  if (env == nullptr || *env == '\0' || std::strcmp(env, "chunks2") == 0) {
    *chunks = 2;
  } else if (std::strcmp(env, "chunks1") == 0) {
    *chunks = 1;
  } else if (std::strcmp(env, "tiled") == 0) {
    *chunks = 0;
  } else {
    return Status::InvalidArgument(std::string(kQuantizeOp) + ": " + kQuantizeRowwiseKernelEnv + "=\"" + env +
                                   "\": expected chunks1, chunks2 or tiled");
  }
  return Status::Ok();
}


template <typename Tag, typename Fmt>
Status LaunchQuantize(const QuantizeFp8Args& a, void* workspace, GpuStream stream) {
  using T = typename Tag::Storage;
  constexpr int kVec = 16 / int(sizeof(T));
  const T* x = static_cast<const T*>(a.x);
  auto* amax_bits = reinterpret_cast<uint32_t*>(a.amax);
  auto aligned = [](const void* p, uintptr_t bytes) {
    return reinterpret_cast<uintptr_t>(p) % bytes == 0;
  };
  const int64_t n = a.rows * a.cols;

  int rowwise_chunks = 0;  // rowwise only, no dbias: the flat kernel's chunks per step (0: tiled)
  if (a.colwise == nullptr && a.dbias == nullptr && a.placement == nullptr) {
    LOWBIT_RETURN_IF_ERROR(ParseRowwiseKernel(&rowwise_chunks));
  }
  if (rowwise_chunks > 0) {
    const bool vec = aligned(x, 16) && aligned(a.rowwise, 16);
    const int blocks = GridStrideBlocks(vec ? (n + kVec * rowwise_chunks - 1) / (kVec * rowwise_chunks) : n,
                                        kThreads, 8);
    if (!vec) {
      QuantizeRowwiseKernel<Tag, Fmt, 1, 1><<<blocks, kThreads, 0, stream>>>(x, n, a.scale, a.rowwise, amax_bits);
    } else if (rowwise_chunks == 2) {
      QuantizeRowwiseKernel<Tag, Fmt, kVec, 2>
          <<<blocks, kThreads, 0, stream>>>(x, n, a.scale, a.rowwise, amax_bits);
    } else {
      QuantizeRowwiseKernel<Tag, Fmt, kVec, 1>
          <<<blocks, kThreads, 0, stream>>>(x, n, a.scale, a.rowwise, amax_bits);
    }
    return LaunchStatus(kQuantizeOp);
  }

  TileVariant variant;
  LOWBIT_RETURN_IF_ERROR(ParseTileVariant(kQuantizeOp, &variant));
  const bool vec_io = aligned(x, 16) && a.cols % kVec == 0;
  float* partials = a.dbias != nullptr ? static_cast<float*>(workspace) : nullptr;  // checked by PrepareDbias
  int tile_height = 0;
  if (a.placement != nullptr && (!vec_io || a.rowwise == nullptr || a.colwise == nullptr)) {
    return Status::InvalidArgument(std::string(kQuantizeOp) + ": placement: needs both copies, 16-byte aligned x "
                                   "and cols a multiple of " + std::to_string(kVec));
  }
  // The placed kernel's index arithmetic (SlicedPlace, quantize.h): rows, cols and the segment
  // and slice heights below 2^31, whole tiles of columns per slice, at most the table's slices.
  if (a.placement != nullptr) {
    const Fp8CopyPlacement& pl = *a.placement;
    const bool ok = a.rows < int64_t(INT32_MAX) && a.cols < int64_t(INT32_MAX) && pl.row_segment_rows > 0 &&
                    pl.row_segment_rows < int64_t(INT32_MAX) && pl.slice_rows > 0 &&
                    pl.slice_rows < int64_t(INT32_MAX) && pl.slice_rows % kQuantizeTileCols == 0 &&
                    (a.cols + pl.slice_rows - 1) / pl.slice_rows <= kFp8PlacementMaxSlices;
    if (!ok) {
      return Status::InvalidArgument(std::string(kQuantizeOp) + ": placement: rows and cols must be below 2^31, "
                                     "row_segment_rows positive and below 2^31, slice_rows a multiple of " +
                                     std::to_string(kQuantizeTileCols) + " covering cols in at most " +
                                     std::to_string(kFp8PlacementMaxSlices) + " slices (got rows " +
                                     std::to_string(a.rows) + ", cols " + std::to_string(a.cols) +
                                     ", row_segment_rows " + std::to_string(pl.row_segment_rows) + ", slice_rows " +
                                     std::to_string(pl.slice_rows) + ")");
    }
  }
  const Status launched =
      a.placement != nullptr  // placed copies (dense_backward.h): vectorized x only
          ? LaunchTiledVariant<Tag, Fmt, true>(kQuantizeOp, a, partials, OneTensor{}, variant, stream, &tile_height,
                                               SlicedPlace{*a.placement})
      : vec_io ? LaunchTiledVariant<Tag, Fmt, true>(kQuantizeOp, a, partials, OneTensor{}, variant, stream, &tile_height)
               : LaunchTiledVariant<Tag, Fmt, false>(kQuantizeOp, a, partials, OneTensor{}, variant, stream, &tile_height);
  LOWBIT_RETURN_IF_ERROR(launched);
  if (a.dbias == nullptr) return Status::Ok();

  const int64_t tile_rows = (a.rows + tile_height - 1) / tile_height;
  return dbias_finalize::LaunchDbiasFinalize<Tag>(partials, tile_rows, a.cols, a.dbias, a.dbias_dtype, kQuantizeOp,
                                                  stream);
}

template <typename Tag, typename Fmt, bool kVector>
__global__ void __launch_bounds__(kThreads)
    DequantizeKernel(const uint8_t* __restrict__ data, int64_t n, const float* __restrict__ scale_inv_ptr,
                     typename Tag::Storage* __restrict__ out) {
  using T = typename Tag::Storage;
  constexpr int kGroup = 8;  // codes per vector step (one 8-byte load)
  const float scale_inv = __ldg(scale_inv_ptr);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if constexpr (kVector) {
    const int64_t groups = n / kGroup;
    for (int64_t i = first; i < groups; i += stride) {
      const uint2 packed = __ldg(reinterpret_cast<const uint2*>(data) + i);
      uint8_t q[kGroup];
      memcpy(q, &packed, sizeof(packed));
      T vals[kGroup];
#pragma unroll
      for (int j = 0; j < kGroup; ++j) vals[j] = StoreFromFloat(Tag{}, DecodeScaled(Fmt{}, q[j], scale_inv));
      uint4 words[sizeof(vals) / 16];
      memcpy(words, vals, sizeof(vals));
      uint4* dst = reinterpret_cast<uint4*>(out + i * kGroup);
#pragma unroll
      for (size_t k = 0; k < sizeof(vals) / 16; ++k) dst[k] = words[k];
    }
    done = groups * kGroup;
  }
  for (int64_t i = done + first; i < n; i += stride) {
    out[i] = StoreFromFloat(Tag{}, DecodeScaled(Fmt{}, data[i], scale_inv));
  }
}

}  // namespace

Status QuantizeFp8Cuda(const QuantizeFp8Args& a, void* workspace, GpuStream stream) {
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(a.amax, 0, sizeof(float), stream), kQuantizeOp,
                                    "cudaMemsetAsync"));
  return DispatchHighPrecision(a.x_dtype, kQuantizeOp, "x", [&](auto tag) {
    using Tag = decltype(tag);
    bool x_empty = false;
    LOWBIT_RETURN_IF_ERROR(dbias_finalize::PrepareDbias<Tag>(kQuantizeOp, a, workspace, stream, &x_empty));
    if (x_empty) return Status::Ok();  // amax and dbias zeroed, every other output empty
    return DispatchFp8(a.out_dtype, kQuantizeOp, "out", [&](auto fmt) {
      return LaunchQuantize<Tag, decltype(fmt)>(a, workspace, stream);
    });
  });
}

Status DequantizeFp8Cuda(const uint8_t* data, DType data_dtype, int64_t n, const float* scale_inv,
                         void* out, DType out_dtype, GpuStream stream) {
  return DispatchHighPrecision(out_dtype, kDequantizeOp, "out", [&](auto tag) {
    return DispatchFp8(data_dtype, kDequantizeOp, "data", [&](auto fmt) {
      using Tag = decltype(tag);
      using T = typename Tag::Storage;
      if (n == 0) return Status::Ok();
      T* dst = static_cast<T*>(out);
      const bool vec = reinterpret_cast<uintptr_t>(data) % 8 == 0 &&
                       reinterpret_cast<uintptr_t>(out) % 16 == 0;
      const int blocks = GridStrideBlocks(vec ? (n + 7) / 8 : n, kThreads, 8);
      if (vec) {
        DequantizeKernel<Tag, decltype(fmt), true><<<blocks, kThreads, 0, stream>>>(data, n, scale_inv, dst);
      } else {
        DequantizeKernel<Tag, decltype(fmt), false><<<blocks, kThreads, 0, stream>>>(data, n, scale_inv, dst);
      }
      return LaunchStatus(kDequantizeOp);
    });
  });
}

}  // namespace lowbit
