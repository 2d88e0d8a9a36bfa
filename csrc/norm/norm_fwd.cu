// CUDA normalization forward (LayerNorm / RMSNorm) with the fused FP8 quantization,
// rowwise and transposed (colwise), and the amax of y (see norm.h for the math).
//
// One row group per row (geometry in norm_cuda.cuh); the row stays in registers between
// the statistics and the output pass; gamma/beta are re-read per row through L1. Blocks
// walk "row tiles" grid-stride. With a colwise output a tile is kTileRows rows whose
// quantized bytes are staged in shared memory ([tile_rows][stride] bytes), then written
// transposed: each column's tile_rows bytes are contiguous in q_colwise, stored as 32-bit
// words (4 rows) when the tile is full and rows % 4 == 0. The tile is sized from a
// kColTileBytes shared-memory budget (16 rows at hidden 4096, 8 at 8192, 4 at 16384), so
// two blocks fit per SM.
#include <cuda_runtime.h>

#include "norm/norm.h"
#include "norm/norm_check.h"
#include "norm/norm_cuda.cuh"
#include "norm/norm_math.h"

namespace lowbit {
namespace {

using namespace norm_cuda;

constexpr const char* kOp = "lowbit_norm_forward";
constexpr int kBlockThreads = 512;          // target block size (several row groups)
constexpr int kColTileBytes = 96 * 1024;    // shared-memory budget of one colwise tile
constexpr int kMaxTileRows = 32;            // 32-byte column segments at most

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
  int64_t rows, hidden;
  int threads_per_row;
  int tile_rows;     // rows per tile (a multiple of the block's row groups)
  int tile_stride;   // bytes per staged row (colwise)
  float epsilon;
  bool layernorm, zero_centered, gamma_f32, e5m2, quantize;
};

// Writes the staged tile rows [r0, r0 + n) transposed into q_col (hidden x rows).
__device__ void WriteTransposed(const FwdParams& p, const uint8_t* tile, int64_t r0, int n) {
  const int h = int(p.hidden);
  const bool words = n == p.tile_rows && n % 4 == 0 && p.rows % 4 == 0 && r0 % 4 == 0 &&
                     reinterpret_cast<uintptr_t>(p.q_col) % 4 == 0;
  if (words) {
    const int per_col = n / 4;
    for (int i = threadIdx.x; i < h * per_col; i += blockDim.x) {
      const int64_t c = i / per_col;
      const int w = i % per_col;
      const uint8_t* src = tile + int64_t(4 * w) * p.tile_stride + c;
      const uint32_t word = uint32_t(src[0]) | (uint32_t(src[p.tile_stride]) << 8) |
                            (uint32_t(src[2 * p.tile_stride]) << 16) |
                            (uint32_t(src[3 * p.tile_stride]) << 24);
      *reinterpret_cast<uint32_t*>(p.q_col + c * p.rows + r0 + 4 * w) = word;
    }
  } else {
    for (int i = threadIdx.x; i < h * n; i += blockDim.x) {
      const int64_t c = i / n;
      const int r = i % n;
      p.q_col[c * p.rows + r0 + r] = tile[int64_t(r) * p.tile_stride + c];
    }
  }
}

template <typename Tag, int kItems, bool kVectorized, bool kWide, bool kColwise>
__global__ void __launch_bounds__(MaxBlockThreads<kItems, kWide>())
    NormForwardKernel(FwdParams p) {
  using T = typename Tag::Storage;
  constexpr int kVec = kVectorized ? 16 / int(sizeof(T)) : 1;
  constexpr int kChunks = kItems / kVec;
  extern __shared__ __align__(16) uint8_t tile[];

  const int tpr = p.threads_per_row;
  const int group = threadIdx.x / tpr, lane = threadIdx.x % tpr;
  const int groups = blockDim.x / tpr, warps_per_row = tpr / 32;
  const int64_t h = p.hidden;
  const float hidden_f = float(h);
  const float scale = p.quantize ? *p.scale : 1.0f;
  const int64_t tiles = (p.rows + p.tile_rows - 1) / p.tile_rows;
  uint32_t amax_bits = 0;

  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = t * p.tile_rows;
    for (int rr = group; rr < p.tile_rows; rr += groups) {
      const int64_t r = r0 + rr;
      const bool row_ok = r < p.rows;
      const T* xr = static_cast<const T*>(p.x) + (row_ok ? r : 0) * h;
      float v[kChunks][kVec];
      float sum[1] = {0.0f};
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const int64_t e = (int64_t(j) * tpr + lane) * kVec;
        if (row_ok && e < h) {
          LoadChunk<Tag, kVec>(xr + e, v[j]);
        } else {
#pragma unroll
          for (int k = 0; k < kVec; ++k) v[j][k] = 0.0f;
        }
#pragma unroll
        for (int k = 0; k < kVec; ++k) sum[0] += v[j][k];
      }
      float mu = 0.0f;
      if (p.layernorm) {
        RowSum<1>(sum, warps_per_row);
        mu = Fp32Div(sum[0], hidden_f);
      }
      float sq[1] = {0.0f};
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const int64_t e = (int64_t(j) * tpr + lane) * kVec;
        if (e < h) {
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            const float d = Fp32Add(v[j][k], -mu);
            sq[0] += Fp32Mul(d, d);
          }
        }
      }
      RowSum<1>(sq, warps_per_row);
      const float rsigma = NormRsigma(Fp32Div(sq[0], hidden_f), p.epsilon);
      if (row_ok && lane == 0) {
        if (p.layernorm) p.mu[r] = mu;
        p.rsigma[r] = rsigma;
      }
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const int64_t e = (int64_t(j) * tpr + lane) * kVec;
        if (!row_ok || e >= h) continue;
        float w[kVec], b[kVec] = {};
        LoadParamChunk<Tag, kVec>(p.gamma, p.gamma_f32, e, w);
        if (p.layernorm) LoadParamChunk<Tag, kVec>(p.beta, p.gamma_f32, e, b);
        float y[kVec];
        Pack<uint8_t, kVec> q;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          y[k] = NormOutput(NormXhat(v[j][k], mu, rsigma), NormWeight(w[k], p.zero_centered),
                            b[k], p.layernorm);
          amax_bits = max(amax_bits, AbsBitsOf(y[k]));
          q.v[k] = NormQuantize(y[k], scale, p.e5m2);
        }
        if (p.y != nullptr) StoreChunk<Tag, kVec>(static_cast<T*>(p.y) + r * h + e, y);
        if (p.q_row != nullptr) *reinterpret_cast<Pack<uint8_t, kVec>*>(p.q_row + r * h + e) = q;
        if constexpr (kColwise) {
          *reinterpret_cast<Pack<uint8_t, kVec>*>(tile + int64_t(rr) * p.tile_stride + e) = q;
        }
      }
    }
    if constexpr (kColwise) {
      __syncthreads();
      const int64_t left = p.rows - r0;
      WriteTransposed(p, tile, r0, int(left < p.tile_rows ? left : p.tile_rows));
      __syncthreads();
    }
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
  const bool aligned = Aligned16(a.x) && Aligned16(a.y) && Aligned16(a.gamma) &&
                       Aligned16(a.beta) && Aligned16(a.q_rowwise);
  const RowGeometry g = ChooseGeometry(a.hidden, int(sizeof(T)), aligned);
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
  p.hidden = a.hidden;
  p.threads_per_row = g.threads_per_row;
  p.epsilon = a.epsilon;
  p.layernorm = a.norm_type == NormType::kLayerNorm;
  p.zero_centered = a.zero_centered_gamma;
  p.gamma_f32 = a.gamma_dtype == DType::kF32;
  p.e5m2 = a.q_dtype == DType::kE5M2;
  p.quantize = a.q_rowwise != nullptr || a.q_colwise != nullptr;

  int groups = 1;  // row groups per block: a power of two, so it divides tile_rows
  // Colwise blocks hold 2 x kBlockThreads when the registers allow: 2 blocks/SM fit the
  // shared-memory tile budget.
  const int block_target = colwise && MaxBlockThreads(g) > kBlockThreads ? 2 * kBlockThreads
                                                                          : kBlockThreads;
  while (groups * 2 * g.threads_per_row <= block_target) groups *= 2;
  size_t smem = 0;
  if (colwise) {
    p.tile_stride = int((a.hidden + 15) / 16 * 16 + 8);  // +8: spread staged rows over banks
    int tile_rows = kMaxTileRows;
    while (tile_rows > 4 && int64_t(tile_rows) * p.tile_stride > kColTileBytes) tile_rows /= 2;
    if (groups > tile_rows) groups = tile_rows;
    p.tile_rows = tile_rows;
    smem = size_t(tile_rows) * size_t(p.tile_stride);
  } else {
    p.tile_rows = groups;
  }
  const int threads = groups * g.threads_per_row;
  const int64_t tiles = (a.rows + p.tile_rows - 1) / p.tile_rows;

  return DispatchGeometry<16 / int(sizeof(T))>(g, kOp, [&](auto items, auto vectorized, auto wide) {
    auto run = [&](auto colwise_tag) -> Status {
      auto kernel = NormForwardKernel<Tag, decltype(items)::value, decltype(vectorized)::value,
                                      decltype(wide)::value, decltype(colwise_tag)::value>;
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
                                std::to_string(threads) + " threads, " +
                                std::to_string(smem) + " bytes of shared memory)");
      }
      const int64_t cap = int64_t(per_sm) * SmCount();
      const int grid = int(tiles < cap ? tiles : cap);
      kernel<<<grid, threads, smem, stream>>>(p);
      return LaunchStatus(kOp);
    };
    return colwise ? run(std::true_type{}) : run(std::false_type{});
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
