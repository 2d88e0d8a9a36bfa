// CUDA normalization backward (see norm.h for the math).
//
// Stage 1 (NormBackwardKernel): one row group per row (geometry: norm_plan.h, norm_cuda.cuh), dz
// and x in registers in their storage type; two row-group sums (sum g, sum g * xhat: warp
// shuffles and one named barrier each, never the whole block); dx written in place, through
// the hardware bf16/f16 conversion for chunks without NaN (norm_cuda.cuh). Each thread also accumulates dz * xhat and dz for its columns over the rows its
// row group visits; at the end every row group writes those as one partial row of the
// fp32 workspace ([2][parts][hidden]: dgamma partials, then dbeta partials).
// Stage 2 (NormBackwardFinalize): sums the parts in a fixed order (8 strided slices, then
// the slices in order) and stores dgamma/dbeta in gamma's dtype. The number of parts
// depends only on the shape and the device (min(row tiles, occupancy limit,
// kNormBwdMaxBlocks) blocks), so results are run-to-run deterministic. The workspace is
// sized by NormBackwardWorkspaceBytes (norm_plan.h) from the shape alone.
#include <cuda_runtime.h>

#include "norm/norm.h"
#include "norm/norm_check.h"
#include "norm/norm_cuda.cuh"
#include "norm/norm_math.h"

namespace lowbit {
namespace {

using namespace norm_cuda;

constexpr const char* kOp = "lowbit_norm_backward";
constexpr int kFinalizeCols = 32, kFinalizeSlices = 8;

struct BwdParams {
  const void* dz;
  const void* x;
  const float* mu;
  const float* rsigma;
  const void* gamma;
  void* dx;
  float* parts;  // [2][num_parts][hidden]
  int64_t rows, hidden, num_parts;
  int threads_per_row;
  bool layernorm, zero_centered, gamma_f32;
};

// Registers: dz and x stay in their storage type (raw 16-byte chunks) and xhat / g are
// recomputed from them for dx, so a thread holds 2 x kItems storage values and the
// 2 x kItems dgamma/dbeta accumulators (the 16-item geometry of hidden 4096 bf16 thus needs
// more than 64 registers; see norm_plan.h).
template <typename Tag, int kItems, bool kVectorized, bool kWide>
__global__ void __launch_bounds__(MaxBlockThreads<kItems, kWide>()) NormBackwardKernel(BwdParams p) {
  using T = typename Tag::Storage;
  constexpr int kVec = kVectorized ? 16 / int(sizeof(T)) : 1;
  constexpr int kChunks = kItems / kVec;
  using Raw = Pack<T, kVec>;
  __shared__ float partial[2][32];
  const int tpr = p.threads_per_row;
  const int group = threadIdx.x / tpr, lane = threadIdx.x - group * tpr;
  const int groups = blockDim.x / tpr;
  const int h = int(p.hidden);
  const float hidden_f = float(h);
  const int64_t tiles = (p.rows + groups - 1) / groups;
  float dgamma[kChunks][kVec] = {}, dbeta[kChunks][kVec] = {};

  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r = t * groups + group;
    const bool row_ok = r < p.rows;
    const int64_t off = (row_ok ? r : 0) * h;
    const float mu = row_ok && p.layernorm ? p.mu[r] : 0.0f;
    const float rsigma = row_ok ? p.rsigma[r] : 0.0f;
    Raw dz_raw[kChunks], x_raw[kChunks];
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int e = (j * tpr + lane) * kVec;
      if (row_ok && e < h) {
        dz_raw[j] = *reinterpret_cast<const Raw*>(static_cast<const T*>(p.dz) + off + e);
        x_raw[j] = *reinterpret_cast<const Raw*>(static_cast<const T*>(p.x) + off + e);
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) dz_raw[j].v[k] = x_raw[j].v[k] = T(0);
      }
    }
    float sum_g = 0.0f, sum_gx = 0.0f;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int e = (j * tpr + lane) * kVec;
      if (!row_ok || e >= h) continue;
      float w[kVec];
      LoadParamChunk<Tag, kVec>(p.gamma, p.gamma_f32, e, w);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float dz = ToFloatFast(Tag{}, dz_raw[j].v[k]);
        const float xhat = NormXhat(ToFloatFast(Tag{}, x_raw[j].v[k]), mu, rsigma);
        const float g = Fp32Mul(dz, NormWeight(w[k], p.zero_centered));
        sum_g += g;
        sum_gx += Fp32Mul(g, xhat);
        dgamma[j][k] += Fp32Mul(dz, xhat);
        dbeta[j][k] += dz;
      }
    }
    // Two sums, two buffers: see RowGroupSum.
    sum_g = RowGroupSum(sum_g, partial[0], group, groups, tpr);
    sum_gx = RowGroupSum(sum_gx, partial[1], group, groups, tpr);
    const float mean_g = p.layernorm ? Fp32Div(sum_g, hidden_f) : 0.0f;
    const float mean_gx = Fp32Div(sum_gx, hidden_f);
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int e = (j * tpr + lane) * kVec;
      if (!row_ok || e >= h) continue;
      float w[kVec], dx[kVec];
      LoadParamChunk<Tag, kVec>(p.gamma, p.gamma_f32, e, w);
      uint32_t chunk_max = 0;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float dz = ToFloatFast(Tag{}, dz_raw[j].v[k]);
        const float xhat = NormXhat(ToFloatFast(Tag{}, x_raw[j].v[k]), mu, rsigma);
        const float g = Fp32Mul(dz, NormWeight(w[k], p.zero_centered));
        dx[k] = NormDx(g, xhat, mean_g, mean_gx, rsigma);
        chunk_max = max(chunk_max, AbsBitsOf(dx[k]));
      }
      StoreChunkFast<Tag, kVec>(static_cast<T*>(p.dx) + off + e, dx, chunk_max <= 0x7F800000u);
    }
  }
  const int64_t part = int64_t(blockIdx.x) * groups + group;
  float* dgamma_part = p.parts + part * h;
  float* dbeta_part = p.parts + (p.num_parts + part) * h;
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int e = (j * tpr + lane) * kVec;
    if (e >= h) continue;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      dgamma_part[e + k] = dgamma[j][k];
      dbeta_part[e + k] = dbeta[j][k];
    }
  }
}

// grid (ceil(hidden / 32), 1 or 2): y = 0 reduces dgamma, y = 1 dbeta.
template <typename GTag>
__global__ void __launch_bounds__(kFinalizeCols * kFinalizeSlices)
    NormBackwardFinalize(const float* parts, int64_t num_parts, int64_t hidden, void* dgamma,
                         void* dbeta) {
  __shared__ float slice_sums[kFinalizeSlices][kFinalizeCols];
  const int col = threadIdx.x % kFinalizeCols, slice = threadIdx.x / kFinalizeCols;
  const int64_t c = int64_t(blockIdx.x) * kFinalizeCols + col;
  const float* src = parts + int64_t(blockIdx.y) * num_parts * hidden;
  float s = 0.0f;
  if (c < hidden) {
    for (int64_t q = slice; q < num_parts; q += kFinalizeSlices) s += src[q * hidden + c];
  }
  slice_sums[slice][col] = s;
  __syncthreads();
  if (slice == 0 && c < hidden) {
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < kFinalizeSlices; ++i) total += slice_sums[i][col];
    auto* out = static_cast<typename GTag::Storage*>(blockIdx.y == 0 ? dgamma : dbeta);
    out[c] = StoreFromFloat(GTag{}, total);
  }
}

// Geometry, block size and grid of stage 1; shared by the workspace query and the launch.
struct BwdPlan {
  RowGeometry geometry;
  int threads = 0, grid = 0;
  int64_t num_parts = 0;
};

template <typename Tag>
Status Plan(int64_t rows, int64_t hidden, bool aligned, BwdPlan* plan) {
  using T = typename Tag::Storage;
  plan->geometry = ChooseGeometry(hidden, int(sizeof(T)), aligned);
  const int groups = NormBwdRowGroups(plan->geometry);
  plan->threads = groups * plan->geometry.threads_per_row;
  const int64_t tiles = (rows + groups - 1) / groups;
  return DispatchGeometry<16 / int(sizeof(T))>(plan->geometry, kOp, [&](auto items, auto vec, auto wide) {
    auto kernel = NormBackwardKernel<Tag, decltype(items)::value, decltype(vec)::value,
                                     decltype(wide)::value>;
    int per_sm = 0;
    LOWBIT_RETURN_IF_ERROR(
        CudaStatus(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, plan->threads, 0),
                   kOp, "cudaOccupancyMaxActiveBlocksPerMultiprocessor"));
    int64_t cap = int64_t(per_sm < 1 ? 1 : per_sm) * SmCount();
    // Never more parts than NormBackwardWorkspaceBytes (norm_plan.h) provides for.
    if (cap > kNormBwdMaxBlocks) cap = kNormBwdMaxBlocks;
    plan->grid = int(tiles < cap ? tiles : cap);
    plan->num_parts = int64_t(plan->grid) * groups;
    return Status::Ok();
  });
}

Status PlanAny(DType dtype, int64_t rows, int64_t hidden, bool aligned, BwdPlan* plan) {
  return DispatchHighPrecision(dtype, kOp, "x", [&](auto tag) {
    return Plan<decltype(tag)>(rows, hidden, aligned, plan);
  });
}

}  // namespace

Status NormBackwardCuda(const NormBackwardArgs& a, void* workspace, size_t workspace_bytes,
                        GpuStream stream) {
  LOWBIT_RETURN_IF_ERROR(CheckNormBackward(a, kOp));
  const bool layernorm = a.norm_type == NormType::kLayerNorm;
  BwdPlan plan;
  if (a.rows > 0) {
    const bool aligned = Aligned16(a.dz) && Aligned16(a.x) && Aligned16(a.dx) &&
                         Aligned16(a.gamma);
    LOWBIT_RETURN_IF_ERROR(PlanAny(a.x_dtype, a.rows, a.hidden, aligned, &plan));
    const size_t need = size_t(2) * size_t(plan.num_parts) * size_t(a.hidden) * sizeof(float);
    if (workspace == nullptr || workspace_bytes < need ||
        reinterpret_cast<uintptr_t>(workspace) % alignof(float) != 0) {
      return Status::Internal(std::string(kOp) + ": workspace: " +
                              std::to_string(workspace_bytes) + " bytes at " +
                              std::to_string(reinterpret_cast<uintptr_t>(workspace)) +
                              ", need " + std::to_string(need) + " bytes, 4-byte aligned");
    }
    BwdParams p{};
    p.dz = a.dz;
    p.x = a.x;
    p.mu = a.mu;
    p.rsigma = a.rsigma;
    p.gamma = a.gamma;
    p.dx = a.dx;
    p.parts = static_cast<float*>(workspace);
    p.rows = a.rows;
    p.hidden = a.hidden;
    p.num_parts = plan.num_parts;
    p.threads_per_row = plan.geometry.threads_per_row;
    p.layernorm = layernorm;
    p.zero_centered = a.zero_centered_gamma;
    p.gamma_f32 = a.gamma_dtype == DType::kF32;
    LOWBIT_RETURN_IF_ERROR(DispatchHighPrecision(a.x_dtype, kOp, "x", [&](auto tag) {
      using Tag = decltype(tag);
      return DispatchGeometry<16 / int(sizeof(typename Tag::Storage))>(
          plan.geometry, kOp, [&](auto items, auto vec, auto wide) {
            NormBackwardKernel<Tag, decltype(items)::value, decltype(vec)::value,
                               decltype(wide)::value>
                <<<plan.grid, plan.threads, 0, stream>>>(p);
            return LaunchStatus(kOp);
          });
    }));
  }
  const dim3 grid(unsigned((a.hidden + kFinalizeCols - 1) / kFinalizeCols), layernorm ? 2 : 1);
  return DispatchHighPrecision(a.gamma_dtype, kOp, "gamma", [&](auto gtag) {
    NormBackwardFinalize<decltype(gtag)><<<grid, kFinalizeCols * kFinalizeSlices, 0, stream>>>(
        static_cast<const float*>(workspace), plan.num_parts, a.hidden, a.dgamma, a.dbeta);
    return LaunchStatus(kOp);
  });
}

}  // namespace lowbit
