// CUDA activation forward (act + quantize + transpose + amax) and backward (dact + dbias
// + quantize + transpose + amax), one pass over the data. Layouts and numerics:
// activation.h; formulas: activation_math.h (shared with the CPU reference, bit-identical).
//
// ActTiledKernel: blocks loop over 64-row x 128-column tiles of the H input columns. Each
// thread walks its 16-byte chunks of the tile (x, the gate half, dz) pass by pass, the next
// pass's loads issued before this pass's math, and computes 1 or 2 output "planes" per element (2 for the gated backward: d x_a goes to
// columns [0, H), d x_g to [H, 2H)). Per plane it stores the high-precision output and the
// rowwise codes, keeps the codes in shared memory for the transposed store (8 lanes write
// 64 contiguous bytes of a colwise row), and writes per-tile column sums for dbias to a
// workspace row per tile row; DbiasFinalizeKernel then adds those rows in a fixed order.
// amax: block max of |v| bit patterns, one unsigned atomicMax (order independent).
// Unaligned data or H % (16 / sizeof(T)) != 0 take the bounds-checked scalar path.
#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <type_traits>

#include "activation/activation.h"
#include "common/cuda_check.h"
#include "common/element.h"
#include "common/reduce.cuh"
#include "quantize/fp8_codec.h"

namespace lowbit {
namespace {

constexpr int kThreads = 256;
constexpr int kTileRows = int(kActTileRows);
constexpr int kTileCols = int(kActTileCols);
constexpr int kCodeStride = kTileCols + 4;  // bytes per shared row of codes (4-aligned)

template <typename T>
struct ActKernelArgs {
  ActParams act;
  int64_t rows, hidden, out_cols, in_cols;
  const T* x;
  const T* dz;
  const float* scale;
  T* out;
  uint8_t* q_rowwise;
  uint8_t* q_colwise;
  bool colwise_vec;  // q_colwise 8-byte aligned and rows % 8 == 0
  bool vector_io;    // 16-byte loads/stores (aligned, H % kVec == 0), else scalar
  bool e5m2;         // code format: E5M2, else E4M3
  uint32_t* amax;
  float* partials;   // tile_rows x out_cols, or null
};

// Hardware conversions, sm_89+ (PTX ISA: cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 and
// cvt.rn.{bf16x2,f16x2}.f32). For non-NaN inputs they give exactly the formats.h codecs'
// bits (round to nearest even; FP8 saturates, bf16/f16 overflow to inf); for NaN they drop
// sign and payload, so chunks holding a NaN take the codecs (EncodeChunk, PackChunk).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define LOWBIT_ACT_HW_CVT 1
#else
#define LOWBIT_ACT_HW_CVT 0
#endif

#if LOWBIT_ACT_HW_CVT
// Two FP8 codes in the low 16 bits: `lo` in bits 0-7, `hi` in bits 8-15.
__device__ __forceinline__ uint32_t CvtFp8X2(bool e5m2, float lo, float hi) {
  uint16_t pair;
  if (e5m2) {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
  }
  return pair;
}
__device__ __forceinline__ uint32_t CvtX2(BF16, float lo, float hi) {
  uint32_t pair;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pair) : "f"(hi), "f"(lo));
  return pair;
}
__device__ __forceinline__ uint32_t CvtX2(F16, float lo, float hi) {
  uint32_t pair;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(pair) : "f"(hi), "f"(lo));
  return pair;
}
#endif

// kVec FP8 codes of v * scale as little-endian words (EncodeScaled's bits). hw_ok: no
// product can be NaN (no NaN in v, scale finite and non-zero).
template <int kVec>
__device__ __forceinline__ void EncodeChunk(bool e5m2, const float (&v)[kVec], float scale, bool hw_ok,
                                            uint32_t (&words)[kVec / 4]) {
#if LOWBIT_ACT_HW_CVT
  if (hw_ok) {
#pragma unroll
    for (int j = 0; j < kVec; j += 4) {
      words[j / 4] = CvtFp8X2(e5m2, __fmul_rn(v[j], scale), __fmul_rn(v[j + 1], scale)) |
                     (CvtFp8X2(e5m2, __fmul_rn(v[j + 2], scale), __fmul_rn(v[j + 3], scale)) << 16);
    }
    return;
  }
#endif
#pragma unroll
  for (int j = 0; j < kVec; j += 4) {
    uint32_t w = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t q = e5m2 ? EncodeScaled(E5m2Fmt{}, v[j + i], scale) : EncodeScaled(E4m3Fmt{}, v[j + i], scale);
      w |= q << (8 * i);
    }
    words[j / 4] = w;
  }
}

// v rounded to the storage type (StoreFromFloat's bits), packed as 16 bytes.
template <typename Tag, int kVec>
__device__ __forceinline__ uint4 PackChunk(const float (&v)[kVec], bool no_nan) {
  using T = typename Tag::Storage;
  uint4 packed;
  if constexpr (sizeof(T) == 2) {
#if LOWBIT_ACT_HW_CVT
    if (no_nan) {
      uint32_t w[kVec / 2];
#pragma unroll
      for (int j = 0; j < kVec; j += 2) w[j / 2] = CvtX2(Tag{}, v[j], v[j + 1]);
      memcpy(&packed, w, sizeof(packed));
      return packed;
    }
#endif
  }
  T hp[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) hp[j] = StoreFromFloat(Tag{}, v[j]);
  memcpy(&packed, hp, sizeof(packed));
  return packed;
}

// x's element as fp32: LoadAsFloat, with f16 by the (exact) hardware conversion instead of
// the branchy software decode. A NaN's payload may differ, which no output can show: every
// result passes CanonicalNan (activation_math.h).
template <typename Tag>
__device__ __forceinline__ float LoadElement(Tag tag, typename Tag::Storage v) {
  if constexpr (std::is_same_v<Tag, F16>) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
  } else {
    return LoadAsFloat(tag, v);
  }
}

// True when scale is finite and non-zero: then x * scale is NaN only where x is NaN.
__device__ __forceinline__ bool ScaleKeepsFinite(float scale) {
  const uint32_t bits = AbsBitsOf(scale);
  return bits != 0 && bits < 0x7F800000u;
}

template <typename T, int kVec>
__device__ __forceinline__ void LoadChunk(const T* src, bool valid, T (&dst)[kVec]) {
  uint4 packed = make_uint4(0, 0, 0, 0);
  if (valid) packed = __ldg(reinterpret_cast<const uint4*>(src));
  memcpy(dst, &packed, sizeof(packed));
}

template <int kVec>
__device__ __forceinline__ void StoreCodes(uint8_t* dst, const uint32_t (&w)[kVec / 4]) {
  if constexpr (kVec == 4) {
    *reinterpret_cast<uint32_t*>(dst) = w[0];
  } else {
    static_assert(kVec == 8, "4 or 8 codes per chunk");
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  }
}

// q = a / b, r = a % b for a < 2^32 and b >= 1, with 32-bit arithmetic only.
__device__ __forceinline__ void DivMod32(uint32_t a, int64_t b, int64_t* q, int64_t* r) {
  if (b > int64_t(a)) {
    *q = 0, *r = a;
  } else {
    *q = a / uint32_t(b), *r = a % uint32_t(b);
  }
}

// Loads pass s's chunks of this thread (out of range -> 0, masked by the caller).
template <typename Tag, bool kBackward, bool kGated, int kVec>
__device__ __forceinline__ void LoadPass(const ActKernelArgs<typename Tag::Storage>& p, int64_t r,
                                         int64_t c, typename Tag::Storage (&xa)[kVec],
                                         typename Tag::Storage (&xg)[kVec],
                                         typename Tag::Storage (&g)[kVec]) {
  using T = typename Tag::Storage;
  if (p.vector_io) {
    const bool ok = r < p.rows && c < p.hidden;
    LoadChunk<T, kVec>(p.x + r * p.in_cols + c, ok, xa);
    if constexpr (kGated) LoadChunk<T, kVec>(p.x + r * p.in_cols + p.hidden + c, ok, xg);
    if constexpr (kBackward) LoadChunk<T, kVec>(p.dz + r * p.hidden + c, ok, g);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const bool ok = r < p.rows && c + j < p.hidden;
      xa[j] = ok ? p.x[r * p.in_cols + c + j] : T(0);
      if constexpr (kGated) xg[j] = ok ? p.x[r * p.in_cols + p.hidden + c + j] : T(0);
      if constexpr (kBackward) g[j] = ok ? p.dz[r * p.hidden + c + j] : T(0);
    }
  }
}

// One kernel per (dtype, forward/backward, gated): the act type, the code format and the
// vector/scalar IO are uniform runtime branches, and the passes of a tile are a rolled
// loop (next pass's loads issued before this pass's math), so each kernel inlines the
// activation math kVec times, not kVec * passes * formats * IO variants (compile time).
template <typename Tag, bool kBackward, bool kGated>
__global__ void __launch_bounds__(kThreads) ActTiledKernel(ActKernelArgs<typename Tag::Storage> p) {
  using T = typename Tag::Storage;
  constexpr int kPlanes = kBackward && kGated ? 2 : 1;
  constexpr int kVec = 16 / int(sizeof(T));
  constexpr int kThreadsPerRow = kTileCols / kVec;
  constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
  constexpr int kPasses = kTileRows / kRowsPerPass;
  __shared__ __align__(16) uint8_t codes[kPlanes][kTileRows][kCodeStride];
  __shared__ float col_partial[kPlanes][kRowsPerPass][kTileCols];

  const bool quantize = p.q_rowwise != nullptr || p.q_colwise != nullptr;
  const float scale = quantize ? __ldg(p.scale) : 1.0f;
  const bool scale_ok = ScaleKeepsFinite(scale);
  const int64_t tiles_c = (p.hidden + kTileCols - 1) / kTileCols;
  const int64_t tile_rows = (p.rows + kTileRows - 1) / kTileRows;
  const int chunk_col = (threadIdx.x % kThreadsPerRow) * kVec;
  const int chunk_row = threadIdx.x / kThreadsPerRow;
  uint32_t best = 0;

  // Tile t = tile_row * tiles_c + tile_col, t = blockIdx.x, blockIdx.x + gridDim.x, ...,
  // stepped without a 64-bit division in the loop (its call would cost registers).
  int64_t tile_row, tile_col, step_rows, step_cols;
  DivMod32(blockIdx.x, tiles_c, &tile_row, &tile_col);
  DivMod32(gridDim.x, tiles_c, &step_rows, &step_cols);
  for (; tile_row < tile_rows; tile_row += step_rows, tile_col += step_cols) {
    if (tile_col >= tiles_c) tile_col -= tiles_c, ++tile_row;
    if (tile_row >= tile_rows) break;
    const int64_t r0 = tile_row * kTileRows;
    const int64_t c0 = tile_col * kTileCols;
    const int64_t c = c0 + chunk_col;

    float col_sum[kPlanes][kVec];
#pragma unroll
    for (int k = 0; k < kPlanes; ++k) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) col_sum[k][j] = 0.0f;
    }
    // 1-2. Per pass: the next pass's loads first, then compute and store each plane of
    // this one; keep codes and column sums.
    T xa[kVec], xg[kVec], g[kVec];
    LoadPass<Tag, kBackward, kGated, kVec>(p, r0 + chunk_row, c, xa, xg, g);
#pragma unroll 1
    for (int s = 0; s < kPasses; ++s) {
      const int local_row = s * kRowsPerPass + chunk_row;
      const int64_t r = r0 + local_row;
      T nxa[kVec], nxg[kVec], ng[kVec];
      if (s + 1 < kPasses) LoadPass<Tag, kBackward, kGated, kVec>(p, r + kRowsPerPass, c, nxa, nxg, ng);
      float v[kPlanes][kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float a = LoadElement(Tag{}, xa[j]);
        const float gate = kGated ? LoadElement(Tag{}, xg[j]) : 0.0f;
        if constexpr (kBackward) {
          float da, dg;
          ActBackwardValue(p.act, LoadElement(Tag{}, g[j]), a, gate, &da, &dg);
          v[0][j] = da;
          if constexpr (kPlanes == 2) v[1][j] = dg;
        } else {
          v[0][j] = ActForwardValue(p.act, a, gate);
        }
      }
      // Elements outside the tensor were loaded as 0, and every activation and gradient
      // maps 0 inputs to 0, so they cannot raise the amax; dbias sums only in-range rows
      // (columns past the end are never written).
#pragma unroll
      for (int k = 0; k < kPlanes; ++k) {
        const int64_t oc = k * p.hidden + c;  // output column of element j = 0
        uint32_t chunk_max = 0;
#pragma unroll
        for (int j = 0; j < kVec; ++j) chunk_max = max(chunk_max, AbsBitsOf(v[k][j]));
        best = max(best, chunk_max);
        if (p.partials != nullptr && r < p.rows) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) col_sum[k][j] += v[k][j];
        }
        const bool no_nan = chunk_max <= 0x7F800000u;
        uint32_t q[kVec / 4] = {};
        if (quantize) EncodeChunk<kVec>(p.e5m2, v[k], scale, no_nan && scale_ok, q);
        if (r < p.rows) {
          if (p.vector_io && c < p.hidden) {
            if (p.out != nullptr) {
              *reinterpret_cast<uint4*>(p.out + r * p.out_cols + oc) = PackChunk<Tag, kVec>(v[k], no_nan);
            }
            if (p.q_rowwise != nullptr) StoreCodes<kVec>(p.q_rowwise + r * p.out_cols + oc, q);
          } else {
#pragma unroll
            for (int j = 0; j < kVec; ++j) {
              if (c + j >= p.hidden) break;
              if (p.out != nullptr) p.out[r * p.out_cols + oc + j] = StoreFromFloat(Tag{}, v[k][j]);
              if (p.q_rowwise != nullptr) p.q_rowwise[r * p.out_cols + oc + j] = uint8_t(q[j / 4] >> (8 * (j % 4)));
            }
          }
        }
        if (p.q_colwise != nullptr) {
#pragma unroll
          for (int j = 0; j < kVec; j += 4) {
            *reinterpret_cast<uint32_t*>(&codes[k][local_row][chunk_col + j]) = q[j / 4];
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        xa[j] = nxa[j];
        if constexpr (kGated) xg[j] = nxg[j];
        if constexpr (kBackward) g[j] = ng[j];
      }
    }

    // 3. dbias: this tile's column sums, its rows combined in a fixed order.
    if (p.partials != nullptr) {
#pragma unroll
      for (int k = 0; k < kPlanes; ++k) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) col_partial[k][chunk_row][chunk_col + j] = col_sum[k][j];
      }
      __syncthreads();
      for (int i = threadIdx.x; i < kPlanes * kTileCols; i += kThreads) {
        const int k = i / kTileCols, col = i % kTileCols;
        float sum = 0.0f;
#pragma unroll
        for (int y = 0; y < kRowsPerPass; ++y) sum += col_partial[k][y][col];
        if (c0 + col < p.hidden) p.partials[tile_row * p.out_cols + k * p.hidden + c0 + col] = sum;
      }
    }

    // 4. colwise: 8-byte words of 8 consecutive rows of one column; 8 lanes per 64 bytes.
    if (p.q_colwise != nullptr) {
      __syncthreads();
      constexpr int kWords = kTileCols * kTileRows / 8;
      for (int w = threadIdx.x; w < kPlanes * kWords; w += kThreads) {
        const int k = w / kWords, col = (w % kWords) >> 3, row8 = (w & 7) * 8;
        const int64_t oc = c0 + col;
        if (oc >= p.hidden) continue;
        uint8_t b[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) b[i] = codes[k][row8 + i][col];
        const int64_t r = r0 + row8;
        uint8_t* dst = p.q_colwise + (k * p.hidden + oc) * p.rows + r;
        if (p.colwise_vec && r + 8 <= p.rows) {
          uint2 word;
          memcpy(&word, b, 8);
          *reinterpret_cast<uint2*>(dst) = word;
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            if (r + i < p.rows) dst[i] = b[i];
          }
        }
      }
    }
    if (p.q_colwise != nullptr || p.partials != nullptr) __syncthreads();
  }
  best = BlockMaxU32(best);
  if (threadIdx.x == 0 && best != 0) atomicMax(p.amax, best);
}

// blockDim (32, 8): row y of the block sums workspace rows y, y + 8, ...; the 8 sums are
// then added in order. Fixed order: the same bits on every run.
template <typename Tag>
__global__ void DbiasFinalizeKernel(const float* __restrict__ partials, int64_t tile_rows,
                                    int64_t cols, typename Tag::Storage* __restrict__ dbias) {
  __shared__ float sums[8][32];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.0f;
  if (c < cols) {
    for (int64_t t = threadIdx.y; t < tile_rows; t += 8) s += partials[t * cols + c];
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = 0.0f;
#pragma unroll
    for (int y = 0; y < 8; ++y) total += sums[y][threadIdx.x];
    dbias[c] = StoreFromFloat(Tag{}, CanonicalNan(total));  // as the reference
  }
}

bool Aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <typename Tag, bool kBackward, bool kGated>
Status Launch(const ActArgs& a, void* workspace, GpuStream stream, const char* op) {
  using T = typename Tag::Storage;
  constexpr int kVec = 16 / int(sizeof(T));
  ActKernelArgs<T> p;
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
  if (kBackward && a.dbias != nullptr && workspace == nullptr) {
    return Status::Internal(std::string(op) + ": dbias: no workspace");
  }
  p.vector_io = a.hidden % kVec == 0 && Aligned(a.x, 16) && Aligned(a.dz, 16) &&
                Aligned(a.out, 16) && Aligned(a.q_rowwise, 16);
  const bool quantize = a.q_rowwise != nullptr || a.q_colwise != nullptr;
  p.e5m2 = quantize && a.q_dtype == DType::kE5M2;
  const int64_t tile_rows = (a.rows + kTileRows - 1) / kTileRows;
  const int64_t tiles = tile_rows * ((a.hidden + kTileCols - 1) / kTileCols);
  const int blocks = GridStrideBlocks(tiles * kThreads, kThreads, 8);
  ActTiledKernel<Tag, kBackward, kGated><<<blocks, kThreads, 0, stream>>>(p);
  LOWBIT_RETURN_IF_ERROR(LaunchStatus(op));
  if (p.partials == nullptr) return Status::Ok();
  const int64_t finalize_blocks = (p.out_cols + 31) / 32;
  if (finalize_blocks > 0x7FFFFFFF) return Status::InvalidArgument(std::string(op) + ": x: too many columns");
  DbiasFinalizeKernel<Tag><<<unsigned(finalize_blocks), dim3(32, 8), 0, stream>>>(
      p.partials, tile_rows, p.out_cols, static_cast<T*>(a.dbias));
  return LaunchStatus(op);
}

Status Run(const ActArgs& a, void* workspace, GpuStream stream, bool backward) {
  const char* op = backward ? "lowbit_act_backward" : "lowbit_act_forward";
  if (a.amax == nullptr) return Status::InvalidArgument(std::string(op) + ": amax: missing");
  const bool quantize = a.q_rowwise != nullptr || a.q_colwise != nullptr;
  if (quantize && a.scale == nullptr) return Status::InvalidArgument(std::string(op) + ": scale: missing");
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(a.amax, 0, sizeof(float), stream), op, "cudaMemsetAsync"));
  return DispatchHighPrecision(a.dtype, op, "x", [&](auto tag) {
    using Tag = decltype(tag);
    if (a.rows == 0 || a.hidden == 0) {
      if (!backward || a.dbias == nullptr || a.hidden == 0) return Status::Ok();
      const size_t bytes = size_t(ActOutCols(a, true)) * sizeof(typename Tag::Storage);
      return CudaStatus(cudaMemsetAsync(a.dbias, 0, bytes, stream), op, "cudaMemsetAsync");
    }
    return DispatchFp8(quantize ? a.q_dtype : DType::kE4M3, op, "q", [&](auto) {
      if (backward) {
        return a.params.gated ? Launch<Tag, true, true>(a, workspace, stream, op)
                              : Launch<Tag, true, false>(a, workspace, stream, op);
      }
      return a.params.gated ? Launch<Tag, false, true>(a, workspace, stream, op)
                            : Launch<Tag, false, false>(a, workspace, stream, op);
    });
  });
}

}  // namespace

Status ActForwardCuda(const ActArgs& a, GpuStream stream) { return Run(a, nullptr, stream, false); }

Status ActBackwardCuda(const ActArgs& a, void* workspace, GpuStream stream) {
  return Run(a, workspace, stream, true);
}

}  // namespace lowbit
