// CUDA normalization backward (see norm.h for the math).
//
// Stage 1 (NormBackwardKernel): the forward's geometry (ChooseRowGeometry: one 16-byte
// chunk of dz and of x per thread up to hidden 8192 for bf16/f16) and its row walk:
// persistent blocks take row tiles grid-stride, one row group per row, and each row group
// issues its next row's dz/x/mu/rsigma loads before the current row's math, so two rows
// per group are in flight. dz and x stay in registers in their storage type; xhat and g are
// recomputed from them for dx. The two row sums (sum g, sum g * xhat) share one warp-shuffle
// tree and one named barrier per row (never the whole block). dx is written through the
// hardware bf16/f16 conversion for chunks without NaN (norm_cuda.cuh). Each thread
// accumulates dz * xhat and dz for its columns over the rows of its group; at the end the
// row groups of a block are summed in shared memory in group order, and the block writes
// one partial row of the fp32 workspace ([2][parts][hidden]: dgamma partials, then dbeta
// partials; parts = blocks).
// Stage 2 (NormBackwardFinalize): sums the parts in a fixed order (8 strided slices, then
// the slices in order) and stores dgamma/dbeta in gamma's dtype. The number of parts
// depends only on the shape and the device (min(row tiles, resident blocks,
// kNormBwdMaxBlocks)), so results are run-to-run deterministic. The workspace is sized by
// NormBackwardWorkspaceBytes (norm_plan.h) from the shape alone.
#include <cuda_runtime.h>

#include <type_traits>

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
  int64_t rows, num_parts;
  int hidden;
  int threads_per_row;
  bool layernorm, zero_centered, gamma_f32;
};

// Hides the value of a raw chunk from the compiler, so that the dx pass recomputes xhat and
// g from dz/x (a few instructions per element) instead of keeping the first pass's fp32
// values live across the row sums (twice the registers of bf16/f16 raw chunks).
template <typename T, int kVec>
__device__ __forceinline__ void Opaque(RawChunk<T, kVec>& c) {
  for (auto& v : c.w.v) {
    if constexpr (sizeof(v) == 4 && std::is_integral_v<std::decay_t<decltype(v)>>) {
      asm volatile("" : "+r"(v));
    } else if constexpr (sizeof(v) == 4) {
      asm volatile("" : "+f"(v));
    } else {
      asm volatile("" : "+h"(v));
    }
  }
}

// One row of one thread: its dz and x chunks and the row's statistics.
template <typename T, int kVec, int kChunks>
struct RowIn {
  RawChunk<T, kVec> dz[kChunks], x[kChunks];
  float mu, rsigma;
};

template <typename T, int kVec, int kChunks>
__device__ __forceinline__ void LoadRow(const BwdParams& p, int64_t r, int lane,
                                        RowIn<T, kVec, kChunks>& in) {
  const bool row_ok = r < p.rows;
  const int64_t off = (row_ok ? r : 0) * p.hidden;
  const int tpr = p.threads_per_row;
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int e = (j * tpr + lane) * kVec;
    if (row_ok && e < p.hidden) {
      LoadRaw(static_cast<const T*>(p.dz) + off + e, in.dz[j]);
      LoadRaw(static_cast<const T*>(p.x) + off + e, in.x[j]);
    } else {
      ZeroRaw(in.dz[j]);
      ZeroRaw(in.x[j]);
    }
  }
  in.mu = row_ok && p.layernorm ? p.mu[r] : 0.0f;
  in.rsigma = row_ok ? p.rsigma[r] : 0.0f;
}

// Row group sums of a and b: warp trees, then (several warps) one named barrier and a warp
// tree over the warp sums in warp order. `partial` is [2][32]; callers alternate two of them
// (parity) so a buffer is rewritten only after the other one's barrier, when every reader
// of it is done.
__device__ __forceinline__ void RowGroupSum2(float& a, float& b, float (*partial)[32], int group,
                                             int groups, int threads_per_row) {
  a = WarpSum(a);
  b = WarpSum(b);
  const int warps_per_row = threads_per_row >> 5;
  if (warps_per_row == 1) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    partial[0][warp] = a;
    partial[1][warp] = b;
  }
  RowGroupBarrier(group, groups, threads_per_row);
  const int first = group * warps_per_row;
  a = WarpSum(lane < warps_per_row ? partial[0][first + lane] : 0.0f);
  b = WarpSum(lane < warps_per_row ? partial[1][first + lane] : 0.0f);
}

// Registers (<= 64: __launch_bounds__(1024)): a thread holds the current and the next row's
// dz/x as raw chunks (RawChunk: 4 registers per tensor for one 16-byte chunk) and w =
// NormWeight(gamma) of its columns; its dgamma/dbeta accumulators live in shared memory.
// Rows of more than 16 bytes per thread and tensor (16 items of bf16/f16: hidden > 8192;
// f32 beyond hidden 4096; the scalar unaligned path beyond 4 items) neither prefetch nor
// keep gamma. The scalar 8- and 16-item kernels still spill a little (unaligned hidden >
// 4096, not a bandwidth path). Rows past the end of the tensor are masked, and every thread of a group
// runs the same iterations (the group barrier of RowGroupSum2).
template <typename Tag, int kItems, bool kVectorized>
__global__ void __launch_bounds__(1024) NormBackwardKernel(BwdParams p) {
  using T = typename Tag::Storage;
  constexpr int kVec = kVectorized ? 16 / int(sizeof(T)) : 1;
  constexpr int kChunks = kItems / kVec;
  // 32-bit registers of one thread's row of one tensor.
  constexpr int kRawWords = kChunks * ((kVec * int(sizeof(T)) + 3) / 4);
  constexpr bool kPrefetch = kRawWords <= 4;
  constexpr bool kKeepGamma = kPrefetch;
  // Accumulator slots: [groups][2 (dgamma, dbeta)][kChunks][kQuads][tpr] slots of kWidth
  // floats; a thread only touches its own (no barrier until the end), and the slots of
  // consecutive lanes are contiguous (bank-conflict free).
  constexpr int kWidth = kVec >= 4 ? 4 : 1, kQuads = kVec / kWidth;
  using Slot = Pack<float, kWidth>;
  extern __shared__ __align__(16) float acc_smem[];
  __shared__ float partial[2][2][32];
  const int tpr = p.threads_per_row;
  const int group = threadIdx.x / tpr, lane = threadIdx.x - group * tpr;
  const int groups = blockDim.x / tpr;
  const int h = p.hidden;
  const float hidden_f = float(h);
  const int64_t tiles = (p.rows + groups - 1) / groups;
  Slot* const acc = reinterpret_cast<Slot*>(acc_smem) + group * (2 * kChunks * kQuads * tpr) + lane;
  auto slot = [&](int a, int j, int q) -> Slot& { return acc[((a * kChunks + j) * kQuads + q) * tpr]; };
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int j = 0; j < kChunks; ++j)
#pragma unroll
      for (int q = 0; q < kQuads; ++q) slot(a, j, q) = Slot{};

  float w_keep[kKeepGamma ? kChunks : 1][kVec];
  if constexpr (kKeepGamma) {
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int e = (j * tpr + lane) * kVec;
      if (e < h) {
        LoadParamChunk<Tag, kVec>(p.gamma, p.gamma_f32, e, w_keep[j]);
#pragma unroll
        for (int k = 0; k < kVec; ++k) w_keep[j][k] = NormWeight(w_keep[j][k], p.zero_centered);
      }
    }
  }
  auto weights = [&](int j, int e, float (&w)[kVec]) {
    if constexpr (kKeepGamma) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) w[k] = w_keep[j][k];
    } else {
      LoadParamChunk<Tag, kVec>(p.gamma, p.gamma_f32, e, w);
#pragma unroll
      for (int k = 0; k < kVec; ++k) w[k] = NormWeight(w[k], p.zero_centered);
    }
  };

  RowIn<T, kVec, kChunks> next;
  int64_t t = blockIdx.x;
  if (kPrefetch && t < tiles) LoadRow(p, t * groups + group, lane, next);
  int parity = 0;
  for (; t < tiles; t += gridDim.x) {
    const int64_t r = t * groups + group;
    const bool row_ok = r < p.rows;  // uniform in the group
    RowIn<T, kVec, kChunks> cur;
    if constexpr (kPrefetch) {
      cur = next;
      if (t + gridDim.x < tiles) LoadRow(p, (t + gridDim.x) * groups + group, lane, next);
    } else {
      LoadRow(p, r, lane, cur);
    }
    float sum_g = 0.0f, sum_gx = 0.0f;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int e = (j * tpr + lane) * kVec;
      if (!row_ok || e >= h) continue;
      float w[kVec], dzx[kVec], dzf[kVec];
      weights(j, e, w);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        dzf[k] = RawToFloat<Tag, kVec>(cur.dz[j], k);
        const float xhat = NormXhat(RawToFloat<Tag, kVec>(cur.x[j], k), cur.mu, cur.rsigma);
        const float g = Fp32Mul(dzf[k], w[k]);
        sum_g += g;
        sum_gx += Fp32Mul(g, xhat);
        dzx[k] = Fp32Mul(dzf[k], xhat);
      }
#pragma unroll
      for (int q = 0; q < kQuads; ++q) {
        Slot sg = slot(0, j, q), sb = slot(1, j, q);
#pragma unroll
        for (int i = 0; i < kWidth; ++i) {
          sg.v[i] += dzx[q * kWidth + i];
          sb.v[i] += dzf[q * kWidth + i];
        }
        slot(0, j, q) = sg;
        slot(1, j, q) = sb;
      }
    }
    RowGroupSum2(sum_g, sum_gx, partial[parity], group, groups, tpr);
    parity ^= 1;
    if (!row_ok) continue;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      Opaque(cur.dz[j]);
      Opaque(cur.x[j]);
    }
    const float mean_g = p.layernorm ? Fp32Div(sum_g, hidden_f) : 0.0f;
    const float mean_gx = Fp32Div(sum_gx, hidden_f);
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int e = (j * tpr + lane) * kVec;
      if (e >= h) continue;
      float w[kVec], dx[kVec];
      weights(j, e, w);
      uint32_t chunk_max = 0;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float dz = RawToFloat<Tag, kVec>(cur.dz[j], k);
        const float xhat = NormXhat(RawToFloat<Tag, kVec>(cur.x[j], k), cur.mu, cur.rsigma);
        dx[k] = NormDx(Fp32Mul(dz, w[k]), xhat, mean_g, mean_gx, cur.rsigma);
        chunk_max = max(chunk_max, AbsBitsOf(dx[k]));
      }
      StoreChunkFast<Tag, kVec>(static_cast<T*>(p.dx) + r * h + e, dx, chunk_max <= 0x7F800000u);
    }
  }

  // The block's partial row: the last row group sums every group's slots of its lanes in
  // group order and stores them.
  __syncthreads();
  if (group != groups - 1) return;
  float* const part[2] = {p.parts + int64_t(blockIdx.x) * h,
                          p.parts + (p.num_parts + blockIdx.x) * h};
  const int stride = 2 * kChunks * kQuads * tpr;  // slots per group
#pragma unroll
  for (int a = 0; a < 2; ++a) {
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int e = (j * tpr + lane) * kVec;
      if (e >= h) continue;
      Pack<float, kVec> out;
#pragma unroll
      for (int q = 0; q < kQuads; ++q) {
        const Slot* s = &slot(a, j, q) - group * stride;  // group 0
        Slot sum = s[0];
#pragma unroll 1
        for (int g = 1; g < groups; ++g) {
#pragma unroll
          for (int i = 0; i < kWidth; ++i) sum.v[i] += s[g * stride].v[i];
        }
#pragma unroll
        for (int i = 0; i < kWidth; ++i) out.v[q * kWidth + i] = sum.v[i];
      }
      *reinterpret_cast<Pack<float, kVec>*>(part[a] + e) = out;
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

// Geometry, block size, shared memory and grid of stage 1.
struct BwdPlan {
  RowGeometry geometry;
  int threads = 0, grid = 0;
  size_t smem = 0;
  int64_t num_parts = 0;
};

template <typename Tag>
Status Plan(int64_t rows, int64_t hidden, bool aligned, BwdPlan* plan) {
  using T = typename Tag::Storage;
  plan->geometry = ChooseRowGeometry(hidden, int(sizeof(T)), aligned);
  const int groups = NormBwdRowGroups(plan->geometry);
  plan->threads = groups * plan->geometry.threads_per_row;
  // The accumulator slots: 2 fp32 per element of the block's rows.
  plan->smem = size_t(2) * size_t(plan->threads) * size_t(plan->geometry.items) * sizeof(float);
  const int64_t tiles = (rows + groups - 1) / groups;
  return DispatchGeometry<16 / int(sizeof(T))>(plan->geometry, kOp, [&](auto items, auto vec) {
    auto kernel = NormBackwardKernel<Tag, decltype(items)::value, decltype(vec)::value>;
    int per_sm = 0;
    LOWBIT_RETURN_IF_ERROR(PrepareLaunch(kernel, plan->threads, plan->smem, kOp, &per_sm));
    int64_t cap = int64_t(per_sm) * DeviceSmCount();
    // Never more parts than NormBackwardWorkspaceBytes (norm_plan.h) provides for.
    if (cap > kNormBwdMaxBlocks) cap = kNormBwdMaxBlocks;
    plan->grid = int(tiles < cap ? tiles : cap);
    plan->num_parts = plan->grid;
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
    // The workspace too: the vectorized kernel stores its partials as 16-byte chunks.
    const bool aligned = Aligned16(a.dz) && Aligned16(a.x) && Aligned16(a.dx) &&
                         Aligned16(a.gamma) && Aligned16(workspace);
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
    p.hidden = int(a.hidden);
    p.num_parts = plan.num_parts;
    p.threads_per_row = plan.geometry.threads_per_row;
    p.layernorm = layernorm;
    p.zero_centered = a.zero_centered_gamma;
    p.gamma_f32 = a.gamma_dtype == DType::kF32;
    LOWBIT_RETURN_IF_ERROR(DispatchHighPrecision(a.x_dtype, kOp, "x", [&](auto tag) {
      using Tag = decltype(tag);
      return DispatchGeometry<16 / int(sizeof(typename Tag::Storage))>(
          plan.geometry, kOp, [&](auto items, auto vec) {
            NormBackwardKernel<Tag, decltype(items)::value, decltype(vec)::value>
                <<<plan.grid, plan.threads, plan.smem, stream>>>(p);
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
