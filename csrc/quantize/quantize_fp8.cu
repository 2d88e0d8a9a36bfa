// CUDA FP8 per-tensor quantize (fused cast + transpose + amax + dbias) and dequantize.
// Numerics and layouts: quantize.h. Kernels:
//   QuantizeRowwiseKernel  rowwise only, no dbias: a flat grid-stride pass, 16-byte loads.
//   QuantizeTiledKernel    anything with colwise or dbias: one resident wave of blocks loops
//                          over 64 x 128 tiles. The next tile is copied into shared memory
//                          (cp.async, double-buffered for 16-bit x) while this one is
//                          encoded: 8 warps encode 16 values per thread (rowwise 16-byte
//                          stores, codes to shared memory), then warps 0-3 gather 16 rows x
//                          4 columns per thread and write the transposed codes as 16-byte
//                          stores (4 lanes cover 64 contiguous bytes of a colwise row) while
//                          warps 4-7 sum the tile's columns into a workspace row (dbias).
//                          Shared-memory layouts are XOR-swizzled: no bank conflicts.
//   DbiasFinalizeKernel    sums the workspace rows in a fixed order (deterministic).
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

constexpr bool kHasCvtFp8x2 = LOWBIT_HAS_CVT_FP8X2;

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

// ---------------------------------------------------------------- tiled kernel
// One 64 x 128 tile per loop step (kTileRows x kTileCols), 256 threads. Shared memory:
//   input  kStages tile buffers of x, row-major, 16-byte chunks swizzled by InputSlot;
//   codes  the tile's FP8 codes, 64 rows x 128 bytes, 16-byte chunks swizzled by CodesSlot;
//   col_partial  dbias column sums of the row groups.
// With two stages the next tile is copied (cp.async, no registers held) while this one
// is encoded, so every block keeps 16 KB of loads in flight; 5 blocks fit an SM
// (41 KB of shared memory and <= 48 registers each).
constexpr int kEncodeCols = 16;                                  // values per encode step: 16 codes
constexpr int kEncodeThreadsPerRow = kTileCols / kEncodeCols;    // 8
constexpr int kEncodeRowsPerPass = kThreads / kEncodeThreadsPerRow;  // 32
constexpr int kTransposeRows = 16;                               // colwise: 16 rows x 4 columns
constexpr int kTransposeCols = 4;                                //   per thread, 16-byte stores
constexpr int kTransposeThreads = (kTileRows / kTransposeRows) * (kTileCols / kTransposeCols);
constexpr int kDbiasThreads = kThreads - kTransposeThreads;     // warps 4-7 sum columns
constexpr int kDbiasBarrier = 1;                                 // named barrier of those warps
constexpr int kTiledBlocksPerSm = 5;                             // shared memory allows 5
static_assert(kTileRows % kEncodeRowsPerPass == 0 && kTransposeThreads == 128 && kDbiasThreads == 128,
              "thread roles assume 256 threads and 64 x 128 tiles");

template <typename T>
struct TileShape {
  static constexpr int kVec = 16 / int(sizeof(T));                // elements per 16-byte chunk
  static constexpr int kRowBytes = kTileCols * int(sizeof(T));    // a multiple of 128: bank 0
  static constexpr int kChunksPerRow = kRowBytes / 16;
  static constexpr int kLoadsPerThread = kTileRows * kChunksPerRow / kThreads;
  static constexpr int kChunksPerEncode = kEncodeCols / kVec;     // = sizeof(T)
  // Two stages (32 KB) for 16-bit x; one 32 KB stage for f32 keeps static shared memory
  // under 48 KB (then the other blocks of the SM hide the load latency).
  static constexpr int kStages = sizeof(T) == 4 ? 1 : 2;
};

// Input chunk j of a row is kept at 16-byte slot j ^ ((j / 8) % 8). An encode step reads
// chunks k * n + i (lane k = 0..7 of a quarter warp, n = 2 or 4): without the swizzle
// those share 16-byte bank groups 2 or 4 ways; with it the 8 lanes hit 8 distinct groups.
// A run of 8 aligned chunks stays a permutation of itself, so the 16-byte copies into
// shared memory and the 4-byte dbias reads (32 consecutive words) are conflict-free too.
__device__ __forceinline__ int InputSlot(int chunk) { return chunk ^ ((chunk >> 3) & 7); }

// Codes chunk j (16 codes) of tile row r is kept at slot j ^ (2 * (r / 16)). The transpose
// reads one 4-byte word per lane from rows 16 * (lane % 4) + k of chunks 2w, 2w + 1: the
// XOR spreads those 8 (row group, chunk) pairs over the 8 bank groups. Rows of a quarter
// warp's 16-byte writes share r, so those stay conflict-free.
__device__ __forceinline__ int CodesSlot(int row, int chunk) { return chunk ^ ((row >> 3) & 6); }

// cp.async (sm_80+, PTX ISA 7.0: https://docs.nvidia.com/cuda/parallel-thread-execution/#data-movement-and-conversion-instructions-cp-async):
// 16-byte global -> shared copies that hold no registers; .cg caches them in L2 only.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define LOWBIT_HAS_CP_ASYNC 1
#else
#define LOWBIT_HAS_CP_ASYNC 0
#endif

__device__ __forceinline__ void CopyAsync16(void* smem, const void* gmem) {
#if LOWBIT_HAS_CP_ASYNC
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(__cvta_generic_to_global(gmem))
               : "memory");
#else
  *static_cast<uint4*>(smem) = __ldg(static_cast<const uint4*>(gmem));
#endif
}

// Commits this thread's copies issued so far as one group.
__device__ __forceinline__ void CopyAsyncCommit() {
#if LOWBIT_HAS_CP_ASYNC
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits for all of this thread's copies; __syncthreads() then publishes them to the block.
__device__ __forceinline__ void CopyAsyncWaitAll() {
#if LOWBIT_HAS_CP_ASYNC
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

// Stores 16 codes (`words`, little-endian) at dst, of which the first `valid` are in range:
// one 16-byte store where dst allows it, else 8-, 4- or 1-byte stores.
__device__ __forceinline__ void StoreCodes16(uint8_t* dst, const uint32_t (&words)[4], int valid) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(dst);
  if (valid >= 16) {
    if (at % 16 == 0) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
      return;
    }
    if (at % 8 == 0) {
      reinterpret_cast<uint2*>(dst)[0] = make_uint2(words[0], words[1]);
      reinterpret_cast<uint2*>(dst)[1] = make_uint2(words[2], words[3]);
      return;
    }
    if (at % 4 == 0) {
#pragma unroll
      for (int k = 0; k < 4; ++k) reinterpret_cast<uint32_t*>(dst)[k] = words[k];
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    if (j < valid) dst[j] = CodeAt(words, j);
  }
}

// Copies the tile starting at x_tile (row pitch `cols`; rows_left x cols_left of it lie
// inside x) into `dst`, zeros elsewhere. kVectorIO: 16-byte cp.async chunks; otherwise
// element loads (unaligned x or cols % kVec != 0), stored synchronously.
template <typename T, bool kVectorIO>
__device__ __forceinline__ void LoadTile(const T* __restrict__ x_tile, int64_t cols, int rows_left, int cols_left,
                                         uint8_t* dst) {
  using Shape = TileShape<T>;
  constexpr int kRowsPerLoad = kThreads / Shape::kChunksPerRow;
  // Consecutive threads copy consecutive chunks; every step moves kRowsPerLoad rows down,
  // so a thread keeps one column and one swizzled slot.
  const int chunk = threadIdx.x % Shape::kChunksPerRow, col = chunk * Shape::kVec;
  const int row0 = threadIdx.x / Shape::kChunksPerRow;
  const T* src = x_tile + row0 * cols + col;
  uint8_t* slot = dst + row0 * Shape::kRowBytes + InputSlot(chunk) * 16;
#pragma unroll
  for (int s = 0; s < Shape::kLoadsPerThread; ++s) {
    const int row = row0 + s * kRowsPerLoad;
    uint8_t* to = slot + s * kRowsPerLoad * Shape::kRowBytes;
    const T* from = src + s * kRowsPerLoad * cols;
    if constexpr (kVectorIO) {
      if (row < rows_left && col < cols_left) {
        CopyAsync16(to, from);
      } else {
        *reinterpret_cast<uint4*>(to) = make_uint4(0, 0, 0, 0);
      }
    } else {
      T vals[Shape::kVec];
#pragma unroll
      for (int e = 0; e < Shape::kVec; ++e) vals[e] = (row < rows_left && col + e < cols_left) ? from[e] : T(0);
      uint4 packed;
      memcpy(&packed, vals, sizeof(packed));
      *reinterpret_cast<uint4*>(to) = packed;
    }
  }
}

// The codec path of EncodeChunk for one encode step (16 values of a tile row held in
// shared memory at `row`, chunks enc_chunk * n ..): 4 values at a time, re-read from
// shared memory, so the 16 inline codecs do not keep 16 values live (the fast path's
// registers would otherwise spill). Rare: only chunks that may produce a NaN get here.
template <typename Tag, typename Fmt>
__device__ __forceinline__ void EncodeStepFromShared(Fmt fmt, const uint8_t* row, int enc_chunk, float scale,
                                                     uint32_t (&words)[kEncodeCols / 4]) {
  using T = typename Tag::Storage;
  using Shape = TileShape<T>;
#pragma unroll 1
  for (int g = 0; g < kEncodeCols / 4; ++g) {
    const int elem = 4 * g;  // first of the 4 values; they share one 16-byte chunk
    const int chunk = enc_chunk * Shape::kChunksPerEncode + elem / Shape::kVec;
    const uint8_t* at = row + InputSlot(chunk) * 16 + (elem % Shape::kVec) * int(sizeof(T));
    T vals[4];
    memcpy(vals, at, sizeof(vals));
    uint8_t q[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) q[j] = EncodeScaled(fmt, LoadAsFloat(Tag{}, vals[j]), scale);
    // Shift the words down so that after the loop words[g] holds group g (no indexing).
    words[0] = words[1];
    words[1] = words[2];
    words[2] = words[3];
    words[3] = Pack4(q);
  }
}

// Byte transpose of a 4 x 4 block: out[j] = byte j of in[0], in[1], in[2], in[3].
__device__ __forceinline__ void Transpose4x4Bytes(const uint32_t* in, uint32_t* out) {
  const uint32_t a_lo = __byte_perm(in[0], in[1], 0x5140), a_hi = __byte_perm(in[0], in[1], 0x7362);
  const uint32_t b_lo = __byte_perm(in[2], in[3], 0x5140), b_hi = __byte_perm(in[2], in[3], 0x7362);
  out[0] = __byte_perm(a_lo, b_lo, 0x5410);
  out[1] = __byte_perm(a_lo, b_lo, 0x7632);
  out[2] = __byte_perm(a_hi, b_hi, 0x5410);
  out[3] = __byte_perm(a_hi, b_hi, 0x7632);
}

// kVectorIO: x is 16-byte aligned and cols % kVec == 0, so every in-range input chunk is
// one 16-byte copy. Stores pick their width from the address at run time (StoreCodes16).
template <typename Tag, typename Fmt, bool kVectorIO>
__global__ void __launch_bounds__(kThreads, kTiledBlocksPerSm)
    QuantizeTiledKernel(const typename Tag::Storage* __restrict__ x, int64_t rows, int64_t cols,
                        const float* __restrict__ scale_ptr, uint8_t* __restrict__ rowwise,
                        uint8_t* __restrict__ colwise, uint32_t* __restrict__ amax,
                        float* __restrict__ partials) {
  using T = typename Tag::Storage;
  using Shape = TileShape<T>;
  constexpr int kDbiasWordsPerRow = Shape::kRowBytes / 4;
  constexpr int kDbiasGroups = kDbiasThreads / kDbiasWordsPerRow;  // 2 (16-bit x) or 1 (f32)
  constexpr int kElemsPerWord = 4 / int(sizeof(T));
  static_assert(kDbiasGroups * kDbiasWordsPerRow == kDbiasThreads, "dbias: whole rows per group");
  __shared__ __align__(128) uint8_t input[Shape::kStages][kTileRows * Shape::kRowBytes];
  __shared__ __align__(128) uint8_t codes[kTileRows * kTileCols];
  __shared__ float col_partial[kDbiasGroups][kTileCols];

  const float scale = __ldg(scale_ptr);
  const bool scale_ok = ScaleKeepsFinite(scale);
  // Tile indices fit 32 bits (2^32 tiles would be 2^45 elements); 32-bit division is cheap.
  const uint32_t tiles_c = uint32_t((cols + kTileCols - 1) / kTileCols);
  const uint32_t tiles = uint32_t((rows + kTileRows - 1) / kTileRows) * tiles_c;
  // Tile `t`: first row and column, and how many of its rows and columns lie inside x.
  auto tile_origin = [&](uint32_t t, int64_t& r0, int64_t& c0, int& rows_left, int& cols_left) {
    r0 = int64_t(t / tiles_c) * kTileRows;
    c0 = int64_t(t % tiles_c) * kTileCols;
    rows_left = int(min(rows - r0, int64_t(kTileRows)));
    cols_left = int(min(cols - c0, int64_t(kTileCols)));
  };
  uint32_t best = 0;
  int stage = 0;

  uint32_t tile = blockIdx.x;
  if (Shape::kStages > 1 && tile < tiles) {
    int64_t r0, c0;
    int rows_left, cols_left;
    tile_origin(tile, r0, c0, rows_left, cols_left);
    LoadTile<T, kVectorIO>(x + r0 * cols + c0, cols, rows_left, cols_left, input[0]);
    CopyAsyncCommit();
  }
  for (; tile < tiles; tile += gridDim.x) {
    int64_t r0, c0;
    int rows_left, cols_left;
    tile_origin(tile, r0, c0, rows_left, cols_left);
    if constexpr (Shape::kStages == 1) {
      LoadTile<T, kVectorIO>(x + r0 * cols + c0, cols, rows_left, cols_left, input[0]);
      CopyAsyncCommit();
    }
    CopyAsyncWaitAll();
    // This tile is visible to all threads, and the previous step is done with `codes`,
    // `col_partial` and the other input stage.
    __syncthreads();
    if constexpr (Shape::kStages > 1) {
      const uint32_t next = tile + gridDim.x;
      if (next < tiles) {
        int64_t nr0, nc0;
        int nrows_left, ncols_left;
        tile_origin(next, nr0, nc0, nrows_left, ncols_left);
        LoadTile<T, kVectorIO>(x + nr0 * cols + nc0, cols, nrows_left, ncols_left, input[stage ^ 1]);
        CopyAsyncCommit();
      }
    }
    const uint8_t* in = input[stage];

    // 1. Encode: thread -> 16 consecutive values of rows t / 8 and t / 8 + 32; amax,
    //    rowwise codes (16-byte stores), codes into shared memory for the transpose.
    const int enc_chunk = threadIdx.x % kEncodeThreadsPerRow;
#pragma unroll 1
    for (int p = 0; p < kTileRows / kEncodeRowsPerPass; ++p) {
      const int local_row = p * kEncodeRowsPerPass + threadIdx.x / kEncodeThreadsPerRow;
      float v[kEncodeCols];
#pragma unroll
      for (int i = 0; i < Shape::kChunksPerEncode; ++i) {
        const int chunk = enc_chunk * Shape::kChunksPerEncode + i;
        const uint4 packed = *reinterpret_cast<const uint4*>(in + local_row * Shape::kRowBytes + InputSlot(chunk) * 16);
        T vals[Shape::kVec];
        memcpy(vals, &packed, sizeof(packed));
#pragma unroll
        for (int e = 0; e < Shape::kVec; ++e) v[i * Shape::kVec + e] = LoadAsFloat(Tag{}, vals[e]);
      }
      uint32_t chunk_max = 0;
#pragma unroll
      for (int j = 0; j < kEncodeCols; ++j) chunk_max = max(chunk_max, AbsBitsOf(v[j]));
      best = max(best, chunk_max);
      uint32_t words[kEncodeCols / 4];
      if (kHasCvtFp8x2 && scale_ok && chunk_max <= 0x7F800000u) {
        EncodeChunk(Fmt{}, v, scale, true, words);
      } else {
        EncodeStepFromShared<Tag>(Fmt{}, in + local_row * Shape::kRowBytes, enc_chunk, scale, words);
      }
      if (rowwise != nullptr && local_row < rows_left) {
        StoreCodes16(rowwise + (r0 + local_row) * cols + c0 + enc_chunk * kEncodeCols, words,
                     cols_left - enc_chunk * kEncodeCols);
      }
      if (colwise != nullptr) {
        *reinterpret_cast<uint4*>(codes + local_row * kTileCols + CodesSlot(local_row, enc_chunk) * 16) =
            make_uint4(words[0], words[1], words[2], words[3]);
      }
    }
    if (colwise != nullptr) __syncthreads();  // codes complete

    if (threadIdx.x < kTransposeThreads) {
      // 2. colwise (warps 0-3): thread -> tile rows row16..row16+15 of 4 columns; the 4
      //    lanes of a column write 64 contiguous bytes of its colwise row, 16 each.
      if (colwise != nullptr) {
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        const int row16 = (lane % 4) * kTransposeRows;
        const int col4 = (warp * 8 + lane / 4) * kTransposeCols;
        // Rows row16..row16+15 share one swizzle (CodesSlot depends on row / 16).
        const uint8_t* src = codes + row16 * kTileCols + CodesSlot(row16, col4 / 16) * 16 + col4 % 16;
        uint32_t w[kTransposeRows];
#pragma unroll
        for (int k = 0; k < kTransposeRows; ++k) w[k] = *reinterpret_cast<const uint32_t*>(src + k * kTileCols);
        uint32_t out[kTransposeCols][4];  // out[j][g]: column j, rows 4g..4g+3
#pragma unroll
        for (int g = 0; g < 4; ++g) {
          uint32_t t[4];
          Transpose4x4Bytes(w + 4 * g, t);
#pragma unroll
          for (int j = 0; j < kTransposeCols; ++j) out[j][g] = t[j];
        }
        if (row16 < rows_left) {
#pragma unroll
          for (int j = 0; j < kTransposeCols; ++j) {  // colwise row c0 + col4 + j, from row r0 + row16
            if (col4 + j < cols_left) {
              StoreCodes16(colwise + (c0 + col4 + j) * rows + r0 + row16, out[j], rows_left - row16);
            }
          }
        }
      }
    } else if (partials != nullptr) {
      // 3. dbias (warps 4-7): thread -> one 4-byte word column over a group of rows, summed
      //    in row order; then the groups in order: this tile's column sums, deterministic.
      const int u = threadIdx.x - kTransposeThreads;
      const int word = u % kDbiasWordsPerRow, group = u / kDbiasWordsPerRow;
      const int offset = InputSlot(word / 4) * 16 + (word % 4) * 4;
      float sum[kElemsPerWord];
#pragma unroll
      for (int e = 0; e < kElemsPerWord; ++e) sum[e] = 0.0f;
#pragma unroll 8
      for (int k = 0; k < kTileRows / kDbiasGroups; ++k) {
        const int row = group * (kTileRows / kDbiasGroups) + k;
        const uint32_t bits = *reinterpret_cast<const uint32_t*>(in + row * Shape::kRowBytes + offset);
        T vals[kElemsPerWord];
        memcpy(vals, &bits, sizeof(bits));
#pragma unroll
        for (int e = 0; e < kElemsPerWord; ++e) sum[e] += LoadAsFloat(Tag{}, vals[e]);
      }
      // col_partial[group][word * kElemsPerWord + e], flat: group * kTileCols + word * kElemsPerWord = u * kElemsPerWord.
#pragma unroll
      for (int e = 0; e < kElemsPerWord; ++e) (&col_partial[0][0])[u * kElemsPerWord + e] = sum[e];
      asm volatile("bar.sync %0, %1;" ::"n"(kDbiasBarrier), "n"(kDbiasThreads) : "memory");
      float s = 0.0f;
#pragma unroll
      for (int g = 0; g < kDbiasGroups; ++g) s += col_partial[g][u];
      if (u < cols_left) partials[r0 / kTileRows * cols + c0 + u] = s;
    }
    if constexpr (Shape::kStages == 1) __syncthreads();  // the next LoadTile overwrites input
    stage = (stage + 1) % Shape::kStages;
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
    // Unrolled so that several loads are in flight; the additions stay in order.
#pragma unroll 8
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
  const bool vec_io = aligned(x, 16) && a.cols % kVec == 0;
  float* partials = a.dbias != nullptr ? static_cast<float*>(workspace) : nullptr;
  if (a.dbias != nullptr && partials == nullptr) {
    return Status::Internal(std::string(kQuantizeOp) + ": dbias: no workspace");
  }
  auto launch_tiled = [&](auto kernel) {
    // One resident wave: every block loops over tiles, so blocks beyond what fits would
    // only start late. The occupancy query is host-side arithmetic (no device sync).
    int per_sm = 0;
    LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0),
                                      kQuantizeOp, "cudaOccupancyMaxActiveBlocksPerMultiprocessor"));
    const int blocks = GridStrideBlocks(tiles * kThreads, kThreads, per_sm > 0 ? per_sm : 1);
    kernel<<<blocks, kThreads, 0, stream>>>(x, a.rows, a.cols, a.scale, a.rowwise, a.colwise, amax_bits,
                                            partials);
    return LaunchStatus(kQuantizeOp);
  };
  LOWBIT_RETURN_IF_ERROR(vec_io ? launch_tiled(QuantizeTiledKernel<Tag, Fmt, true>)
                                : launch_tiled(QuantizeTiledKernel<Tag, Fmt, false>));
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
