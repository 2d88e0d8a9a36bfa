// CUDA FP8 per-tensor quantize (fused cast + transpose + amax + dbias) and dequantize.
// Numerics and layouts: quantize.h. Kernels:
//   QuantizeRowwiseKernel  rowwise only, no dbias: a flat grid-stride pass, 16-byte loads.
//   QuantizeTiledKernel    anything with colwise or dbias: blocks loop over 64 x 128
//                          tiles; each thread loads its 16-byte chunks of a tile first
//                          (bytes in flight), encodes them once, stores the rowwise codes
//                          and keeps them in shared memory, from which the transposed
//                          codes are gathered 4 columns x 8 rows at a time and written as
//                          8-byte stores (8 lanes cover 64 contiguous bytes of a colwise
//                          row). Per-tile column sums go to a workspace row per tile row.
//   DbiasFinalizeKernel    sums the workspace rows in a fixed order (deterministic).
//   DequantizeKernel       flat, 8 codes per thread step.
// Encoding: sm_89+ converts two values per cvt.rn.satfinite instruction, bit-identical to
// the formats.h codecs except for NaN; chunks that may hold a NaN product use the codecs
// (EncodeChunk), whose NaN sign comes from MulNanDefined (a GPU multiply returns the
// sign-less 0x7FFFFFFF for any NaN), so the result equals the CPU reference bit for bit.
// amax: each block reduces |x| bit patterns, then one unsigned atomicMax on the zeroed
// result (order-independent, so deterministic). Partial tiles and unaligned data take
// bounds-checked scalar paths; nothing is read or written outside the tensors.
#include <cuda_runtime.h>

#include <cstring>

#include "common/cuda_check.h"
#include "common/element.h"
#include "common/reduce.cuh"
#include "quantize/fp8_codec.h"
#include "quantize/quantize.h"

namespace lowbit {
namespace {

constexpr const char* kQuantizeOp = "lowbit_quantize_fp8";
constexpr const char* kDequantizeOp = "lowbit_dequantize_fp8";
constexpr int kThreads = 256;
constexpr int kTileRows = int(kQuantizeTileRows);
constexpr int kTileCols = int(kQuantizeTileCols);
// Shared-memory row of codes, in bytes: 4-byte aligned; the +4 spreads the 8 row
// chunks a warp reads over two bank groups instead of one.
constexpr int kCodeStride = kTileCols + 4;
static_assert((kTileCols / 4) * (kTileRows / 8) == kThreads, "one colwise item per thread");

__device__ __forceinline__ uint32_t Pack4(const uint8_t* q) {
  return uint32_t(q[0]) | (uint32_t(q[1]) << 8) | (uint32_t(q[2]) << 16) | (uint32_t(q[3]) << 24);
}

// Hardware FP8 conversion, sm_89 and later (PTX ISA 7.8: cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32,
// https://docs.nvidia.com/cuda/parallel-thread-execution/#data-movement-and-conversion-instructions-cvt):
// round to nearest even, out-of-range values and inf saturate to +-max. That is exactly
// FloatToE4m3 / FloatToE5m2 except for NaN (the hardware drops its sign), so chunks whose
// products may be NaN take the formats.h codec instead (see EncodeChunk).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define LOWBIT_HAS_CVT_FP8X2 1
#else
#define LOWBIT_HAS_CVT_FP8X2 0
#endif

#if LOWBIT_HAS_CVT_FP8X2
// Two codes in the low 16 bits: `lo` in bits 0-7, `hi` in bits 8-15.
__device__ __forceinline__ uint32_t CvtX2(E4m3Fmt, float lo, float hi) {
  uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
  return pair;
}
__device__ __forceinline__ uint32_t CvtX2(E5m2Fmt, float lo, float hi) {
  uint16_t pair;
  asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
  return pair;
}
#endif

// True when scale is finite and non-zero: then x * scale is NaN only where x is NaN.
__device__ __forceinline__ bool ScaleKeepsFinite(float scale) {
  const uint32_t bits = AbsBitsOf(scale);
  return bits != 0 && bits < 0x7F800000u;
}

// Encodes kN values (a multiple of 4) into kN / 4 little-endian words of codes.
// `no_nan`: no product can be NaN (finite non-zero scale, no NaN in v), so the hardware
// conversion gives the formats.h codec's bits.
template <typename Fmt, int kN>
__device__ __forceinline__ void EncodeChunk(Fmt fmt, const float (&v)[kN], float scale, bool no_nan,
                                            uint32_t (&words)[kN / 4]) {
#if LOWBIT_HAS_CVT_FP8X2
  if (no_nan) {
#pragma unroll
    for (int j = 0; j < kN; j += 4) {
      words[j / 4] = CvtX2(fmt, v[j] * scale, v[j + 1] * scale) |
                     (CvtX2(fmt, v[j + 2] * scale, v[j + 3] * scale) << 16);
    }
    return;
  }
#endif
  uint8_t q[kN];
#pragma unroll
  for (int j = 0; j < kN; ++j) q[j] = EncodeScaled(fmt, v[j], scale);
#pragma unroll
  for (int j = 0; j < kN; j += 4) words[j / 4] = Pack4(q + j);
}

__device__ __forceinline__ uint8_t CodeAt(const uint32_t* words, int j) {
  return uint8_t(words[j / 4] >> (8 * (j % 4)));
}

// Stores kVec codes (4 or 8 bytes) with one aligned store.
template <int kVec>
__device__ __forceinline__ void StoreCodesVec(uint8_t* dst, const uint32_t (&words)[kVec / 4]) {
  if constexpr (kVec == 4) {
    *reinterpret_cast<uint32_t*>(dst) = words[0];
  } else {
    static_assert(kVec == 8, "4 or 8 codes per chunk");
    *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
  }
}

template <typename Tag, typename Fmt, int kVec>
__global__ void __launch_bounds__(kThreads)
    QuantizeRowwiseKernel(const typename Tag::Storage* __restrict__ x, int64_t n,
                          const float* __restrict__ scale_ptr, uint8_t* __restrict__ rowwise,
                          uint32_t* __restrict__ amax) {
  using T = typename Tag::Storage;
  const float scale = __ldg(scale_ptr);
  const bool scale_ok = ScaleKeepsFinite(scale);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t best = 0;
  int64_t done = 0;
  if constexpr (kVec > 1) {
    const int64_t nvec = n / kVec;
    const uint4* vec = reinterpret_cast<const uint4*>(x);
    for (int64_t i = first; i < nvec; i += stride) {
      const uint4 packed = __ldg(vec + i);
      T vals[kVec];
      memcpy(vals, &packed, sizeof(packed));
      float v[kVec];
      uint32_t chunk_max = 0;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        v[j] = LoadAsFloat(Tag{}, vals[j]);
        chunk_max = max(chunk_max, AbsBitsOf(v[j]));
      }
      best = max(best, chunk_max);
      uint32_t words[kVec / 4];
      EncodeChunk(Fmt{}, v, scale, scale_ok && chunk_max <= 0x7F800000u, words);
      StoreCodesVec<kVec>(rowwise + i * kVec, words);
    }
    done = nvec * kVec;
  }
  for (int64_t i = done + first; i < n; i += stride) {
    const float v = LoadAsFloat(Tag{}, x[i]);
    best = max(best, AbsBitsOf(v));
    rowwise[i] = EncodeScaled(Fmt{}, v, scale);
  }
  best = BlockMaxU32(best);
  if (threadIdx.x == 0 && best != 0) atomicMax(amax, best);
}

// kVectorIO: x is 16-byte aligned, cols % kVec == 0 and rowwise (if any) 16-byte aligned,
// so every in-range chunk is one 16-byte load and one kVec-byte store. colwise_vec: rows
// % 8 == 0 and colwise 8-byte aligned, so full 8-row chunks are 8-byte stores.
template <typename Tag, typename Fmt, bool kVectorIO>
__global__ void __launch_bounds__(kThreads)
    QuantizeTiledKernel(const typename Tag::Storage* __restrict__ x, int64_t rows, int64_t cols,
                        const float* __restrict__ scale_ptr, uint8_t* __restrict__ rowwise,
                        uint8_t* __restrict__ colwise, bool colwise_vec,
                        uint32_t* __restrict__ amax, float* __restrict__ partials) {
  using T = typename Tag::Storage;
  constexpr int kVec = 16 / int(sizeof(T));  // elements per 16-byte chunk
  constexpr int kThreadsPerRow = kTileCols / kVec;
  constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
  constexpr int kPasses = kTileRows / kRowsPerPass;
  __shared__ __align__(16) uint8_t codes[kTileRows][kCodeStride];
  __shared__ float col_partial[kRowsPerPass][kTileCols];

  const float scale = __ldg(scale_ptr);
  const bool scale_ok = ScaleKeepsFinite(scale);
  const int64_t tiles_c = (cols + kTileCols - 1) / kTileCols;
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows * tiles_c;
  const int chunk_col = (threadIdx.x % kThreadsPerRow) * kVec;  // first column of my chunk
  const int chunk_row = threadIdx.x / kThreadsPerRow;           // my row within a pass
  uint32_t best = 0;

  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t tile_row = tile / tiles_c;
    const int64_t r0 = tile_row * kTileRows;
    const int64_t c0 = (tile % tiles_c) * kTileCols;
    const int64_t c = c0 + chunk_col;

    // 1. Issue every load of this thread's chunks before using any (out of range -> 0).
    T vals[kPasses][kVec];
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int64_t r = r0 + p * kRowsPerPass + chunk_row;
      if constexpr (kVectorIO) {
        uint4 packed = make_uint4(0, 0, 0, 0);
        if (r < rows && c < cols) packed = __ldg(reinterpret_cast<const uint4*>(x + r * cols + c));
        memcpy(vals[p], &packed, sizeof(packed));
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          vals[p][j] = (r < rows && c + j < cols) ? x[r * cols + c + j] : T(0);
        }
      }
    }

    // 2. Encode once: amax, rowwise codes, codes into shared memory, column sums.
    float col_sum[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) col_sum[j] = 0.0f;
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int local_row = p * kRowsPerPass + chunk_row;
      const int64_t r = r0 + local_row;
      float v[kVec];
      uint32_t chunk_max = 0;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        v[j] = LoadAsFloat(Tag{}, vals[p][j]);
        chunk_max = max(chunk_max, AbsBitsOf(v[j]));
        col_sum[j] += v[j];
      }
      best = max(best, chunk_max);
      uint32_t words[kVec / 4];
      EncodeChunk(Fmt{}, v, scale, scale_ok && chunk_max <= 0x7F800000u, words);
      if (rowwise != nullptr && r < rows) {
        if (kVectorIO && c < cols) {
          StoreCodesVec<kVec>(rowwise + r * cols + c, words);
        } else {
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            if (c + j < cols) rowwise[r * cols + c + j] = CodeAt(words, j);
          }
        }
      }
      if (colwise != nullptr) {
#pragma unroll
        for (int j = 0; j < kVec; j += 4) {
          *reinterpret_cast<uint32_t*>(&codes[local_row][chunk_col + j]) = words[j / 4];
        }
      }
    }

    // 3. dbias: this tile's column sums, rows combined in a fixed order.
    if (partials != nullptr) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) col_partial[chunk_row][chunk_col + j] = col_sum[j];
      __syncthreads();
      for (int i = threadIdx.x; i < kTileCols; i += kThreads) {
        float s = 0.0f;
#pragma unroll
        for (int g = 0; g < kRowsPerPass; ++g) s += col_partial[g][i];
        if (c0 + i < cols) partials[tile_row * cols + c0 + i] = s;
      }
    }

    // 4. colwise: thread -> 4 tile columns x 8 tile rows; 8 lanes write 64 contiguous bytes.
    if (colwise != nullptr) {
      __syncthreads();
      const int row8 = (threadIdx.x % 8) * 8;
      const int col4 = (threadIdx.x / 8) * 4;
      uint32_t w[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) w[k] = *reinterpret_cast<const uint32_t*>(&codes[row8 + k][col4]);
      // Byte transpose: out_lo[j] holds column j of rows 0..3, out_hi[j] of rows 4..7.
      uint32_t out_lo[4], out_hi[4];
      {
        const uint32_t a_lo = __byte_perm(w[0], w[1], 0x5140), a_hi = __byte_perm(w[0], w[1], 0x7362);
        const uint32_t b_lo = __byte_perm(w[2], w[3], 0x5140), b_hi = __byte_perm(w[2], w[3], 0x7362);
        const uint32_t e_lo = __byte_perm(w[4], w[5], 0x5140), e_hi = __byte_perm(w[4], w[5], 0x7362);
        const uint32_t f_lo = __byte_perm(w[6], w[7], 0x5140), f_hi = __byte_perm(w[6], w[7], 0x7362);
        out_lo[0] = __byte_perm(a_lo, b_lo, 0x5410);
        out_lo[1] = __byte_perm(a_lo, b_lo, 0x7632);
        out_lo[2] = __byte_perm(a_hi, b_hi, 0x5410);
        out_lo[3] = __byte_perm(a_hi, b_hi, 0x7632);
        out_hi[0] = __byte_perm(e_lo, f_lo, 0x5410);
        out_hi[1] = __byte_perm(e_lo, f_lo, 0x7632);
        out_hi[2] = __byte_perm(e_hi, f_hi, 0x5410);
        out_hi[3] = __byte_perm(e_hi, f_hi, 0x7632);
      }
      const int64_t r = r0 + row8;  // first of my 8 input rows = colwise column
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t oc = c0 + col4 + j;  // colwise row
        if (oc >= cols) break;
        uint8_t* dst = colwise + oc * rows + r;
        if (colwise_vec && r + 8 <= rows) {
          *reinterpret_cast<uint2*>(dst) = make_uint2(out_lo[j], out_hi[j]);
        } else {
#pragma unroll
          for (int k = 0; k < 8; ++k) {
            const uint32_t word = k < 4 ? out_lo[j] : out_hi[j];
            if (r + k < rows) dst[k] = uint8_t(word >> (8 * (k % 4)));
          }
        }
      }
    }
    // Shared memory is rewritten by the next tile.
    if (colwise != nullptr || partials != nullptr) __syncthreads();
  }
  best = BlockMaxU32(best);
  if (threadIdx.x == 0 && best != 0) atomicMax(amax, best);
}

// blockDim (32, 8): warp y sums tile rows y, y+8, ... of 32 columns; the 8 partial sums
// are then added in order y = 0..7. Fixed order: the same bits on every run.
constexpr int kFinalizeRows = 8;

template <typename Tag, typename OutT>
__global__ void DbiasFinalizeKernel(const float* __restrict__ partials, int64_t tile_rows,
                                    int64_t cols, OutT* __restrict__ dbias) {
  __shared__ float sums[kFinalizeRows][32];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.0f;
  if (c < cols) {
    for (int64_t t = threadIdx.y; t < tile_rows; t += kFinalizeRows) s += partials[t * cols + c];
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = 0.0f;
#pragma unroll
    for (int y = 0; y < kFinalizeRows; ++y) total += sums[y][threadIdx.x];
    if constexpr (sizeof(OutT) == sizeof(float)) {
      dbias[c] = total;
    } else {
      dbias[c] = StoreFromFloat(Tag{}, total);
    }
  }
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

  if (a.colwise == nullptr && a.dbias == nullptr) {
    const bool vec = aligned(x, 16) && aligned(a.rowwise, 16);
    const int blocks = GridStrideBlocks(vec ? (n + kVec - 1) / kVec : n, kThreads, 8);
    if (vec) {
      QuantizeRowwiseKernel<Tag, Fmt, kVec>
          <<<blocks, kThreads, 0, stream>>>(x, n, a.scale, a.rowwise, amax_bits);
    } else {
      QuantizeRowwiseKernel<Tag, Fmt, 1>
          <<<blocks, kThreads, 0, stream>>>(x, n, a.scale, a.rowwise, amax_bits);
    }
    return LaunchStatus(kQuantizeOp);
  }

  const int64_t tile_rows = (a.rows + kTileRows - 1) / kTileRows;
  const int64_t tiles = tile_rows * ((a.cols + kTileCols - 1) / kTileCols);
  const int blocks = GridStrideBlocks(tiles * kThreads, kThreads, 8);
  const bool vec_io = aligned(x, 16) && a.cols % kVec == 0 &&
                      (a.rowwise == nullptr || aligned(a.rowwise, 16));
  const bool colwise_vec = a.colwise != nullptr && aligned(a.colwise, 8) && a.rows % 8 == 0;
  float* partials = a.dbias != nullptr ? static_cast<float*>(workspace) : nullptr;
  if (a.dbias != nullptr && partials == nullptr) {
    return Status::Internal(std::string(kQuantizeOp) + ": dbias: no workspace");
  }
  if (vec_io) {
    QuantizeTiledKernel<Tag, Fmt, true><<<blocks, kThreads, 0, stream>>>(
        x, a.rows, a.cols, a.scale, a.rowwise, a.colwise, colwise_vec, amax_bits, partials);
  } else {
    QuantizeTiledKernel<Tag, Fmt, false><<<blocks, kThreads, 0, stream>>>(
        x, a.rows, a.cols, a.scale, a.rowwise, a.colwise, colwise_vec, amax_bits, partials);
  }
  LOWBIT_RETURN_IF_ERROR(LaunchStatus(kQuantizeOp));
  if (a.dbias == nullptr) return Status::Ok();

  const dim3 finalize_block(32, kFinalizeRows);
  const int64_t finalize_blocks = (a.cols + 31) / 32;
  if (finalize_blocks > 0x7FFFFFFF) {
    return Status::InvalidArgument(std::string(kQuantizeOp) + ": x: too many columns");
  }
  if (a.dbias_dtype == DType::kF32) {
    DbiasFinalizeKernel<Tag, float><<<unsigned(finalize_blocks), finalize_block, 0, stream>>>(
        partials, tile_rows, a.cols, static_cast<float*>(a.dbias));
  } else {
    DbiasFinalizeKernel<Tag, T><<<unsigned(finalize_blocks), finalize_block, 0, stream>>>(
        partials, tile_rows, a.cols, static_cast<T*>(a.dbias));
  }
  return LaunchStatus(kQuantizeOp);
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
    if (a.dbias != nullptr && a.dbias_dtype != DType::kF32 && a.dbias_dtype != a.x_dtype) {
      return Status::InvalidArgument(std::string(kQuantizeOp) + ": dbias: expected f32 or " +
                                     DTypeName(a.x_dtype) + ", got " + DTypeName(a.dbias_dtype));
    }
    if (a.rows == 0 || a.cols == 0) {
      // Nothing to encode; the column sums of zero rows are zeros (0 bits in every dtype).
      if (a.dbias == nullptr || a.cols == 0) return Status::Ok();
      const size_t bytes = size_t(a.cols) * (a.dbias_dtype == DType::kF32 ? sizeof(float)
                                                                             : sizeof(typename Tag::Storage));
      return CudaStatus(cudaMemsetAsync(a.dbias, 0, bytes, stream), kQuantizeOp, "cudaMemsetAsync");
    }
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
