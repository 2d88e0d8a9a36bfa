// CUDA normalization forward (LayerNorm / RMSNorm) with the fused FP8 quantization,
// rowwise and transposed (colwise), and the amax of y (see norm.h for the math).
//
// One row group per row (geometry in norm_cuda.cuh); the row stays in registers between
// the statistics and the output pass. Blocks are persistent and walk "row tiles"
// grid-stride; each row group loads its next row (raw 16-byte chunks) before the current
// row's reductions, so two rows per group are in flight (rows of <= 8 items per thread). Row sums reduce within the row
// group only (shuffles, then one named barrier per sum), never across the block.
// Conversions: y to bf16/f16 and the FP8 codes use the hardware cvt.rn instructions, exact
// against the formats.h codecs except for NaN; a chunk holding a NaN (seen from its amax
// bits), or any chunk when scale is 0/inf/NaN, takes the codecs. Outputs are template
// switches (quantize, colwise), so the plain forward does no FP8 work.
// Colwise: a tile is kTileRows rows whose codes are staged in shared memory ([tile_rows]
// [stride] bytes, stride = hidden rounded up to 16, + 4 so that stride / 4 is odd and the
// transposing reads are bank-conflict free), then written transposed: each thread takes 4
// columns x 16 (or 4) rows, transposes 4x4 byte blocks with byte permutes and stores 16 (4)
// contiguous bytes per column; with 32-row tiles two neighbouring lanes write each column's
// full 32-byte segment. Tiles are 32 rows while 32 staged rows fit the kColTileBytes budget
// (hidden <= ~5000), else 16 (<= ~10000) or 8 rows; one 1024-thread block per SM.
#include <cuda_runtime.h>

#include "norm/norm.h"
#include "norm/norm_check.h"
#include "norm/norm_cuda.cuh"
#include "norm/norm_math.h"

namespace lowbit {
namespace {

using namespace norm_cuda;

constexpr const char* kOp = "lowbit_norm_forward";
constexpr int kBlockThreads = 512;          // target block size without colwise
constexpr int kColBlockThreads = 1024;      // target block size with colwise
constexpr int kColTileBytes = 160 * 1024;   // shared-memory budget of one colwise tile
constexpr int kMaxTileRows = 32;            // 32-byte column segments
constexpr int kMaxRowGroups = 15;           // named barriers 1..15

struct FwdParams {
  const void* x;
  const void* gamma;
  const void* beta;
  const float* scale;
  void* y;
  float* mu;
  float* rsigma;
  uint8_t* q_row;
  uint8_t* q_col;
  uint32_t* amax_bits;
  int64_t rows;
  int hidden;
  int threads_per_row;
  int tile_rows;      // rows per tile (a multiple of the block's row groups)
  int tile_rows_log2;
  int tile_stride;    // bytes per staged row (colwise)
  float epsilon;
  bool layernorm, zero_centered, gamma_f32, e5m2;
  bool col_words;     // q_col 16-byte aligned, hidden % 4 == 0 (word transposes)
};

// 4x4 byte transpose: w[i] holds byte j of row i at bits 8j; out[j] holds byte i of column
// j at bits 8i.
__device__ __forceinline__ void Transpose4x4(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3,
                                             uint32_t (&out)[4]) {
  const uint32_t lo01 = __byte_perm(w0, w1, 0x5140), hi01 = __byte_perm(w0, w1, 0x7362);
  const uint32_t lo23 = __byte_perm(w2, w3, 0x5140), hi23 = __byte_perm(w2, w3, 0x7362);
  out[0] = __byte_perm(lo01, lo23, 0x5410);
  out[1] = __byte_perm(lo01, lo23, 0x7632);
  out[2] = __byte_perm(hi01, hi23, 0x5410);
  out[3] = __byte_perm(hi01, hi23, 0x7632);
}

// Writes kG rows x 4 columns (rows rs.., columns c..) of the staged tile to q_col rows r0 +
// rs.., as kG contiguous bytes per column (one 16- or 4-byte store).
template <int kG>
__device__ __forceinline__ void WriteColumnBlock(const FwdParams& p, const uint8_t* tile,
                                                 int64_t r0, int rs, int c) {
  uint32_t cols[4][kG / 4];
#pragma unroll
  for (int m = 0; m < kG / 4; ++m) {
    const uint8_t* src = tile + (rs + 4 * m) * p.tile_stride + c;
    uint32_t t[4];
    Transpose4x4(*reinterpret_cast<const uint32_t*>(src),
                 *reinterpret_cast<const uint32_t*>(src + p.tile_stride),
                 *reinterpret_cast<const uint32_t*>(src + 2 * p.tile_stride),
                 *reinterpret_cast<const uint32_t*>(src + 3 * p.tile_stride), t);
#pragma unroll
    for (int j = 0; j < 4; ++j) cols[j][m] = t[j];
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint8_t* dst = p.q_col + int64_t(c + j) * p.rows + r0 + rs;
    if constexpr (kG == 16) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(cols[j][0], cols[j][1], cols[j][2], cols[j][3]);
    } else {
      *reinterpret_cast<uint32_t*>(dst) = cols[j][0];
    }
  }
}

// Writes the staged tile rows [r0, r0 + n) transposed into q_col (hidden x rows).
__device__ __forceinline__ void WriteTransposed(const FwdParams& p, const uint8_t* tile, int64_t r0, int n) {
  const int h = p.hidden;
  const bool full = n == p.tile_rows;
  if (p.col_words && p.rows % 16 == 0 && n % 16 == 0) {
    // Row blocks of 16 (r0 is a multiple of 16: tile_rows >= 16 here, since n % 16 == 0).
    const int per_col = n >> 4, items = (h >> 2) * per_col;
    const int shift = full ? p.tile_rows_log2 - 4 : 0;
    for (int i = threadIdx.x; i < items; i += blockDim.x) {
      const int rb = full ? (i & (per_col - 1)) : i % per_col;
      const int cb = full ? (i >> shift) : i / per_col;
      WriteColumnBlock<16>(p, tile, r0, rb * 16, cb * 4);
    }
  } else if (p.col_words && p.rows % 4 == 0 && n % 4 == 0) {
    const int per_col = n >> 2, items = (h >> 2) * per_col;
    for (int i = threadIdx.x; i < items; i += blockDim.x) {
      WriteColumnBlock<4>(p, tile, r0, (i % per_col) * 4, (i / per_col) * 4);
    }
  } else {
    for (int i = threadIdx.x; i < h * n; i += blockDim.x) {
      const int c = i / n, r = i - c * n;
      p.q_col[int64_t(c) * p.rows + r0 + r] = tile[r * p.tile_stride + c];
    }
  }
}

template <typename Tag, int kVec, int kChunks>
__device__ __forceinline__ void LoadRowRaw(const FwdParams& p, int64_t r, int lane,
                                           Pack<typename Tag::Storage, kVec> (&raw)[kChunks]) {
  using T = typename Tag::Storage;
  const T* xr = static_cast<const T*>(p.x) + r * p.hidden;
  const int tpr = p.threads_per_row;
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int e = (j * tpr + lane) * kVec;
    if (r < p.rows && e < p.hidden) {
      raw[j] = *reinterpret_cast<const Pack<T, kVec>*>(xr + e);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) raw[j].v[k] = T(0);
    }
  }
}

// Rows of a block, in order: tile t = blockIdx.x, blockIdx.x + gridDim.x, ...; within a
// tile, row group g takes rows g, g + groups, ... Every group of a block runs the same
// number of iterations (rows past the end are masked); only colwise tiles synchronize the
// whole block.
template <typename Tag, int kItems, bool kVectorized, bool kQuant, bool kColwise>
__global__ void __launch_bounds__(1024) NormForwardKernel(FwdParams p) {
  using T = typename Tag::Storage;
  constexpr int kVec = kVectorized ? 16 / int(sizeof(T)) : 1;
  constexpr int kChunks = kItems / kVec;
  using Raw = Pack<T, kVec>;
  extern __shared__ __align__(16) uint8_t tile[];
  __shared__ float partial[2][32];

  const int tpr = p.threads_per_row;
  const int group = threadIdx.x / tpr, lane = threadIdx.x - group * tpr;
  const int groups = blockDim.x / tpr;
  const int h = p.hidden;
  const float hidden_f = float(h);
  const float scale = kQuant ? *p.scale : 1.0f;
  const bool scale_ok = kQuant && ScaleKeepsFinite(scale);
  const int64_t tiles = (p.rows + p.tile_rows - 1) / p.tile_rows;
  uint32_t amax_bits = 0;
  int parity = 0;

  // 16-item rows (hidden > 8192 for 2-byte x) have no registers left for a second row.
  constexpr bool kPrefetch = kItems <= 8;
  Raw raw[kChunks];
  int64_t t = blockIdx.x;
  int rr = group;
  if (kPrefetch && t < tiles) LoadRowRaw<Tag, kVec, kChunks>(p, t * p.tile_rows + rr, lane, raw);
  while (t < tiles) {
    const int64_t r0 = t * p.tile_rows;
    const int64_t r = r0 + rr;
    const bool row_ok = r < p.rows;
    // The row stays in its storage type (half the registers of fp32 for bf16/f16) and is
    // converted where used (one instruction per element and use).
    Raw cur[kChunks];
    if constexpr (kPrefetch) {
#pragma unroll
      for (int j = 0; j < kChunks; ++j) cur[j] = raw[j];
    } else {
      LoadRowRaw<Tag, kVec, kChunks>(p, r, lane, cur);
    }
    // The next row of this group (maybe in the next tile), loaded now.
    int next_rr = rr + groups;
    int64_t next_t = t;
    if (next_rr >= p.tile_rows) {
      next_rr = group;
      next_t = t + gridDim.x;
    }
    if (kPrefetch && next_t < tiles) {
      LoadRowRaw<Tag, kVec, kChunks>(p, next_t * p.tile_rows + next_rr, lane, raw);
    }

    float mu = 0.0f;
    if (p.layernorm) {
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kChunks; ++j)
#pragma unroll
        for (int k = 0; k < kVec; ++k) sum += ToFloatFast(Tag{}, cur[j].v[k]);
      sum = RowGroupSum(sum, partial[parity], group, groups, tpr);
      parity ^= 1;
      mu = Fp32Div(sum, hidden_f);
    }
    float sq = 0.0f;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      if ((j * tpr + lane) * kVec < h) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float d = Fp32Add(ToFloatFast(Tag{}, cur[j].v[k]), -mu);
          sq += Fp32Mul(d, d);
        }
      }
    }
    sq = RowGroupSum(sq, partial[parity], group, groups, tpr);
    parity ^= 1;
    const float rsigma = NormRsigma(Fp32Div(sq, hidden_f), p.epsilon);
    if (row_ok && lane == 0) {
      if (p.layernorm) p.mu[r] = mu;
      p.rsigma[r] = rsigma;
    }
    if (row_ok) {
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const int e = (j * tpr + lane) * kVec;
        if (e >= h) continue;
        float w[kVec], b[kVec] = {};
        LoadParamChunk<Tag, kVec>(p.gamma, p.gamma_f32, e, w);
        if (p.layernorm) LoadParamChunk<Tag, kVec>(p.beta, p.gamma_f32, e, b);
        float y[kVec];
        uint32_t chunk_max = 0;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          y[k] = NormOutput(NormXhat(ToFloatFast(Tag{}, cur[j].v[k]), mu, rsigma), NormWeight(w[k], p.zero_centered),
                            b[k], p.layernorm);
          chunk_max = max(chunk_max, AbsBitsOf(y[k]));
        }
        amax_bits = max(amax_bits, chunk_max);
        const bool no_nan = chunk_max <= 0x7F800000u;
        if (p.y != nullptr) StoreChunkFast<Tag, kVec>(static_cast<T*>(p.y) + r * h + e, y, no_nan);
        if constexpr (kQuant) {
          Pack<uint8_t, kVec> q;
          EncodeFp8<kVec>(y, scale, p.e5m2, scale_ok && no_nan, q.v);
          if (p.q_row != nullptr) *reinterpret_cast<Pack<uint8_t, kVec>*>(p.q_row + r * h + e) = q;
          if constexpr (kColwise) {
            uint8_t* dst = tile + rr * p.tile_stride + e;
            if constexpr (kVec % 4 == 0) {
#pragma unroll
              for (int k = 0; k < kVec; k += 4) {  // staged rows are only 4-byte aligned
                *reinterpret_cast<uint32_t*>(dst + k) =
                    uint32_t(q.v[k]) | (uint32_t(q.v[k + 1]) << 8) |
                    (uint32_t(q.v[k + 2]) << 16) | (uint32_t(q.v[k + 3]) << 24);
              }
            } else {
#pragma unroll
              for (int k = 0; k < kVec; ++k) dst[k] = q.v[k];
            }
          }
        }
      }
    }
    if constexpr (kColwise) {
      if (next_t != t) {  // the tile is done: every group of the block gets here together
        __syncthreads();
        const int64_t left = p.rows - r0;
        WriteTransposed(p, tile, r0, int(left < p.tile_rows ? left : p.tile_rows));
        __syncthreads();
      }
    }
    t = next_t;
    rr = next_rr;
  }
  if (p.amax_bits != nullptr) {
    amax_bits = BlockMaxU32(amax_bits);
    if (threadIdx.x == 0 && amax_bits != 0) atomicMax(p.amax_bits, amax_bits);
  }
}

template <typename Tag>
Status Launch(const NormForwardArgs& a, GpuStream stream) {
  using T = typename Tag::Storage;
  const bool colwise = a.q_colwise != nullptr;
  const bool quant = colwise || a.q_rowwise != nullptr;
  const bool aligned = Aligned16(a.x) && Aligned16(a.y) && Aligned16(a.gamma) &&
                       Aligned16(a.beta) && Aligned16(a.q_rowwise);
  const RowGeometry g = ChooseRowGeometry(a.hidden, int(sizeof(T)), aligned);
  FwdParams p{};
  p.x = a.x;
  p.gamma = a.gamma;
  p.beta = a.beta;
  p.scale = a.scale;
  p.y = a.y;
  p.mu = a.mu;
  p.rsigma = a.rsigma;
  p.q_row = static_cast<uint8_t*>(a.q_rowwise);
  p.q_col = static_cast<uint8_t*>(a.q_colwise);
  p.amax_bits = reinterpret_cast<uint32_t*>(a.amax);
  p.rows = a.rows;
  p.hidden = int(a.hidden);
  p.threads_per_row = g.threads_per_row;
  p.epsilon = a.epsilon;
  p.layernorm = a.norm_type == NormType::kLayerNorm;
  p.zero_centered = a.zero_centered_gamma;
  p.gamma_f32 = a.gamma_dtype == DType::kF32;
  p.e5m2 = a.q_dtype == DType::kE5M2;
  p.col_words = colwise && Aligned16(a.q_colwise) && a.hidden % 4 == 0;

  // Row groups per block: a power of two (so it divides tile_rows), at most 15 (named
  // barriers), the block at most the target size.
  int groups = 1;
  const int block_target = colwise ? kColBlockThreads : kBlockThreads;
  while (groups * 2 * g.threads_per_row <= block_target && groups * 2 <= kMaxRowGroups) {
    groups *= 2;
  }
  size_t smem = 0;
  if (colwise) {
    p.tile_stride = int((a.hidden + 15) / 16 * 16 + 4);  // stride / 4 odd: see the preamble
    int tile_rows = kMaxTileRows;
    while (tile_rows > 4 && int64_t(tile_rows) * p.tile_stride > kColTileBytes) tile_rows /= 2;
    if (groups > tile_rows) groups = tile_rows;
    p.tile_rows = tile_rows;
    smem = size_t(tile_rows) * size_t(p.tile_stride);
  } else {
    p.tile_rows = groups;
  }
  int log2 = 0;
  while ((1 << log2) < p.tile_rows) ++log2;
  p.tile_rows_log2 = log2;
  const int threads = groups * g.threads_per_row;
  const int64_t tiles = (a.rows + p.tile_rows - 1) / p.tile_rows;

  auto launch = [&](auto kernel) -> Status {
    if (smem > 48 * 1024) {
      LOWBIT_RETURN_IF_ERROR(CudaStatus(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
          kOp, "cudaFuncSetAttribute"));
    }
    int per_sm = 0;
    LOWBIT_RETURN_IF_ERROR(CudaStatus(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem), kOp,
        "cudaOccupancyMaxActiveBlocksPerMultiprocessor"));
    if (per_sm < 1) {
      return Status::Internal(std::string(kOp) + ": kernel does not fit on an SM (" +
                              std::to_string(threads) + " threads, " + std::to_string(smem) +
                              " bytes of shared memory)");
    }
    const int64_t cap = int64_t(per_sm) * SmCount();
    const int grid = int(tiles < cap ? tiles : cap);
    kernel<<<grid, threads, smem, stream>>>(p);
    return LaunchStatus(kOp);
  };
  return DispatchGeometry<16 / int(sizeof(T))>(g, kOp, [&](auto items, auto vectorized) {
    constexpr int kI = decltype(items)::value;
    constexpr bool kV = decltype(vectorized)::value;
    if (colwise) return launch(NormForwardKernel<Tag, kI, kV, true, true>);
    if (quant) return launch(NormForwardKernel<Tag, kI, kV, true, false>);
    return launch(NormForwardKernel<Tag, kI, kV, false, false>);
  });
}

}  // namespace

Status NormForwardCuda(const NormForwardArgs& a, GpuStream stream) {
  LOWBIT_RETURN_IF_ERROR(CheckNormForward(a, kOp));
  if (a.amax != nullptr) {
    LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(a.amax, 0, sizeof(float), stream), kOp,
                                      "cudaMemsetAsync"));
  }
  if (a.rows == 0) return Status::Ok();
  return DispatchHighPrecision(a.x_dtype, kOp, "x",
                               [&](auto tag) { return Launch<decltype(tag)>(a, stream); });
}

}  // namespace lowbit
