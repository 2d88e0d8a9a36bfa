// CUDA normalization forward (LayerNorm / RMSNorm) with the fused FP8 quantization,
// rowwise and transposed (colwise), and the amax of y (see norm.h for the math).
// This file: the launch plan (row geometry, block size, shared memory, tiles, clusters,
// carveout) and NormForwardCuda. The kernel and its design: norm_fwd_kernel.cuh; FwdParams,
// the colwise cluster-tile barriers and transposed stores: norm_fwd_device.cuh (both private
// to this translation unit: an unnamed namespace).
// Tuning (items per thread, stages, block sizes): NormFwdTuning in norm_plan.h, overridable
// through LOWBIT_NORM_FWD_VARIANT for benchmarks.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "norm/norm.h"
#include "norm/norm_check.h"
#include "norm/norm_cuda.cuh"
#include "norm/norm_fwd_device.cuh"
#include "norm/norm_fwd_kernel.cuh"
#include "norm/norm_math.h"
#include "norm/norm_plan.h"

namespace lowbit {
namespace {

using namespace norm_cuda;

// The smallest shared memory carveout (bytes) of sm_80..sm_100 (0, 8, 16, 32, 64, 100, 132,
// 164, 196, 228 KB, up to the SM's maximum) that holds `need` bytes; -1 if none does.
int64_t CarveoutFor(int64_t need, int64_t sm_smem) {
  for (int kb : {0, 8, 16, 32, 64, 100, 132, 164, 196, 228}) {
    if (int64_t(kb) * 1024 > sm_smem) break;
    if (int64_t(kb) * 1024 >= need) return int64_t(kb) * 1024;
  }
  return -1;
}

int Log2(int v) {
  int l = 0;
  while ((1 << l) < v) ++l;
  return l;
}

template <typename Tag>
Status Launch(const NormForwardArgs& a, const NormFwdTuning& tune, GpuStream stream) {
  using T = typename Tag::Storage;
  const bool colwise = a.q_colwise != nullptr;
  const bool quant = colwise || a.q_rowwise != nullptr;
  const bool aligned = Aligned16(a.x) && Aligned16(a.y) && Aligned16(a.gamma) &&
                       Aligned16(a.beta) && Aligned16(a.q_rowwise);
  const RowGeometry g = ChooseRowGeometry(a.hidden, int(sizeof(T)), aligned, tune.items);
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

  // Row groups per block: a power of two, the block at most the target size, at most 8
  // (named barriers 1..15) unless a row is one warp (no barrier).
  const int tpr = g.threads_per_row;
  const int max_groups = tpr == 32 ? 32 : 8;
  // parkeep: the colwise kernel that holds gamma/beta in registers (kParamRegs), for
  // vectorized rows of at most kParamRegsThreads threads, in blocks of at most that many.
  const bool param_regs =
      colwise && g.vectorized && tune.parkeep == 1 && tpr <= kParamRegsThreads;
  const int target = !colwise  ? tune.block
                     : param_regs ? (tune.colblock < kParamRegsThreads ? tune.colblock
                                                                       : kParamRegsThreads)
                                  : tune.colblock;
  int groups = 1;
  while (groups * 2 * tpr <= target && groups * 2 <= max_groups) groups *= 2;
  int stages = !g.vectorized ? 1 : param_regs && tune.parstages > 0 ? tune.parstages : tune.stages;
  p.tile_stride = colwise ? int((a.hidden + 15) / 16 * 16 + 4) : 0;  // stride / 4 odd
  const int64_t row_bytes = g.vectorized ? int64_t(g.items) * int64_t(sizeof(T)) : 0;
  // parsmem: fp32 gamma (+ beta) after the row stages and the codes tile (rounded up to 16
  // bytes), for the kernels that do not keep them in registers (kKeepParams: <= 8 items per
  // thread without colwise).
  bool parsmem = g.vectorized && (colwise || g.items > 8) && tune.parsmem == 1 && !param_regs;
  const int64_t param_smem = a.hidden * 4 * (p.layernorm ? 2 : 1);
  auto stage_bytes = [&](int tile_rows) {
    const int64_t gr = groups < tile_rows ? groups : tile_rows;
    return int64_t(stages) * gr * tpr * row_bytes;
  };
  auto smem_for = [&](int tile_rows) {
    const int64_t tile = colwise ? int64_t(tile_rows) * p.tile_stride : 0;
    return stage_bytes(tile_rows) + (parsmem ? (tile + 15) / 16 * 16 + param_smem : tile);
  };
  int device = 0, max_smem = 48 * 1024, sm_smem = 0, major = 0, cluster_launch = 0;
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), kOp, "cudaGetDevice"));
  for (auto [attr, out] : {std::pair{cudaDevAttrMaxSharedMemoryPerBlockOptin, &max_smem},
                           std::pair{cudaDevAttrMaxSharedMemoryPerMultiprocessor, &sm_smem},
                           std::pair{cudaDevAttrComputeCapabilityMajor, &major},
                           std::pair{cudaDevAttrClusterLaunch, &cluster_launch}}) {
    LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaDeviceGetAttribute(out, attr, device), kOp,
                                      "cudaDeviceGetAttribute"));
  }
  const int64_t max_dynamic = int64_t(max_smem) - kStaticSmem;
  // Colwise: column segments of `span` = colspan rows (32, 64 or 128 bytes per column
  // store; 16-byte halves of a sector written apart in time cost HBM read-modify-writes and
  // doubled the kernel's time on H100). A block stages tile_rows rows of codes; a cluster
  // of span / tile_rows blocks (sm_90+, at most 16) writes a span-row tile. Auto: the
  // largest block tile (up to span) that lets two blocks share an SM, else the largest that
  // fits. Without clusters tiles are 32 rows where they fit (else 16 and down).
  // l1keep: the colwise kernel reloads gamma (and beta) per row through L1, which is what
  // the shared memory leaves of the unified L1/shared storage (sm_smem + 28 KB on sm_80..
  // sm_100); two blocks of the largest tile left too little (28 KB at 8192, whose f32
  // gamma + beta are 64 KB: every row read them from L2). So the two blocks' tiles are
  // chosen to leave the parameters + 8 KB of L1, and the carveout is set to the smallest
  // that holds the resident blocks. Blocks of more than 512 threads never pair on an SM (64
  // registers per thread): they take the largest tile that fits.
  const bool clusters = colwise && major >= 9 && cluster_launch != 0;
  const int64_t param_bytes = param_regs ? 0  // no parameter loads in the row loop
      : a.hidden * (p.gamma_f32 ? 4 : int64_t(sizeof(T))) * (p.layernorm ? 2 : 1);
  const bool l1keep = colwise && tune.l1keep == 1;
  // parsmem only where it fits beside the stages and a 4-row tile (else per-row loads).
  if (parsmem && smem_for(colwise ? 4 : groups) > max_dynamic) parsmem = false;
  const int span = tune.colspan;
  // Two blocks per SM only where their threads fit (64 registers per thread: 1024 threads;
  // the parkeep kernel takes more than 64).
  const bool pair_ok = 2 * groups * tpr <= 1024 && !param_regs;
  int tile_rows = groups;
  if (colwise) {
    tile_rows = clusters ? span : kMaxTileRows;  // span >= 32
    if (tune.coltile != 0 && clusters) {
      tile_rows = tune.coltile;
    } else if (clusters) {
      // Two blocks per SM (1 KB reserved per block), with l1keep in a carveout that leaves
      // the parameters + 8 KB of L1.
      const int64_t half = int64_t(sm_smem) / 2 - 1024 - kStaticSmem;
      auto fits_two = [&](int rows) {
        const int64_t need = 2 * (smem_for(rows) + kStaticUsed + 1024);
        const int64_t carve = CarveoutFor(need, sm_smem);
        const int64_t l1 = int64_t(sm_smem) + kL1Floor - carve;
        return smem_for(rows) <= half && (!l1keep || (carve >= 0 && l1 >= param_bytes + 8 * 1024));
      };
      if (pair_ok) {
        while (tile_rows > 4 && !fits_two(tile_rows)) tile_rows /= 2;
      }
      if (!pair_ok || (!fits_two(tile_rows) && smem_for(tile_rows) > half)) {
        tile_rows = span;
        while (tile_rows > 4 && smem_for(tile_rows) > max_dynamic) tile_rows /= 2;
      }
    }
  }
  if (groups > tile_rows) groups = tile_rows;
  auto smem_of = [&]() { return smem_for(tile_rows); };
  // Shrink until it fits: colwise tiles down to 16 rows, stages down to 2, tiles down to 4
  // rows, gamma/beta back to per-row loads (parsmem), one stage, fewer groups.
  while (smem_of() > max_dynamic) {
    if (colwise && tile_rows > 16) {
      tile_rows /= 2;
    } else if (stages > 2) {
      --stages;
    } else if (colwise && tile_rows > 4) {
      tile_rows /= 2;
    } else if (parsmem) {
      parsmem = false;
    } else if (stages > 1) {
      --stages;
    } else if (groups > 1) {
      groups /= 2;
    } else {
      return Status::Internal(std::string(kOp) + ": no launch plan fits the shared memory (" +
                              std::to_string(smem_of()) + " bytes)");
    }
    if (groups > tile_rows) groups = tile_rows;
    if (!colwise) tile_rows = groups;
  }
  p.tile_rows = tile_rows;
  p.tile_rows_log2 = Log2(tile_rows);
  p.per_tile_log2 = Log2(tile_rows / groups);
  p.stages = stages;
  p.param_offset =
      parsmem ? int(stage_bytes(tile_rows) + (int64_t(tile_rows) * p.tile_stride + 15) / 16 * 16) : 0;
  p.interleave = colwise && tune.colorder == 1;
  p.split_sync = colwise && tune.colsplit == 1;
  p.shared_fences = colwise && tune.colbar == 1;
  auto set_cluster = [&](int c) {
    p.cluster = c;
    p.cluster_log2 = Log2(c);
    p.tiles = (a.rows + int64_t(tile_rows) * c - 1) / (int64_t(tile_rows) * c);
  };
  const int cluster = clusters && span > tile_rows ? span / tile_rows : 1;
  set_cluster(cluster < kMaxCluster ? cluster : kMaxCluster);
  const int threads = groups * tpr;
  const size_t smem = size_t(smem_of());

  auto launch = [&](auto kernel) -> Status {
    // The carveout hint (colwise, l1keep) is per kernel and sticky: back to the default
    // first, so that a hint set for another shape does not lower this one's occupancy.
    auto set_carveout = [&](int percent) {
      return CudaStatus(
          cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, percent),
          kOp, "cudaFuncSetAttribute(PreferredSharedMemoryCarveout)");
    };
    if (colwise) LOWBIT_RETURN_IF_ERROR(set_carveout(-1));  // cudaSharedmemCarveoutDefault
    int per_sm = 0;
    LOWBIT_RETURN_IF_ERROR(PrepareLaunch(kernel, threads, smem, kOp, &per_sm));
    if (l1keep && sm_smem > 0) {  // percent of the maximum; the driver rounds it up
      const int64_t carve =
          CarveoutFor(int64_t(per_sm) * (int64_t(smem) + kStaticUsed + 1024), sm_smem);
      if (carve >= 0) LOWBIT_RETURN_IF_ERROR(set_carveout(int(carve * 100 / sm_smem)));
    }
    // Clusters of more than 8 blocks (non-portable) where the GPU allows them; a cluster
    // that does not fit is halved (shorter column segments, same results).
    cudaLaunchAttribute attr[1] = {};
    attr[0].id = cudaLaunchAttributeClusterDimension;
    cudaLaunchConfig_t config = {};
    config.blockDim = dim3(unsigned(threads));
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = attr;
    config.numAttrs = 1;
    int max_clusters = 0;
    while (p.cluster > 1) {
      if (p.cluster > 8 &&
          cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) !=
              cudaSuccess) {
        cudaGetLastError();  // not sticky; take the portable size
        set_cluster(8);
        continue;
      }
      attr[0].val.clusterDim.x = unsigned(p.cluster);
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      config.gridDim = dim3(unsigned(p.cluster));
      max_clusters = 0;
      if (cudaOccupancyMaxActiveClusters(&max_clusters, kernel, &config) != cudaSuccess) {
        cudaGetLastError();  // treated as "does not fit"
        max_clusters = 0;
      }
      if (max_clusters >= 1) break;
      set_cluster(p.cluster / 2);
    }
    if (p.cluster == 1) {
      const int64_t cap = int64_t(per_sm) * DeviceSmCount();
      const int grid = int(p.tiles < cap ? p.tiles : cap);
      kernel<<<grid, threads, smem, stream>>>(p);
      return LaunchStatus(kOp);
    }
    const int64_t n = p.tiles < max_clusters ? p.tiles : max_clusters;
    config.gridDim = dim3(unsigned(n * p.cluster));
    LOWBIT_RETURN_IF_ERROR(
        CudaStatus(cudaLaunchKernelEx(&config, kernel, p), kOp, "cudaLaunchKernelEx"));
    return LaunchStatus(kOp);
  };
  return DispatchGeometry<16 / int(sizeof(T))>(g, kOp, [&](auto items, auto vectorized) {
    constexpr bool kV = decltype(vectorized)::value;
    constexpr int kC = decltype(items)::value / (kV ? 16 / int(sizeof(T)) : 1);
    if constexpr (kV) {
      if (param_regs) return launch(NormForwardKernel<Tag, kC, kV, true, true, true>);
    }
    if (colwise) return launch(NormForwardKernel<Tag, kC, kV, true, true>);
    if (quant) return launch(NormForwardKernel<Tag, kC, kV, true, false>);
    return launch(NormForwardKernel<Tag, kC, kV, false, false>);
  });
}

}  // namespace

Status NormForwardCuda(const NormForwardArgs& a, GpuStream stream) {
  LOWBIT_RETURN_IF_ERROR(CheckNormForward(a, kOp));
  NormFwdTuning tune;
  std::string error;
  if (!ParseNormFwdTuning(std::getenv("LOWBIT_NORM_FWD_VARIANT"), &tune, &error)) {
    return Status::InvalidArgument(std::string(kOp) + ": LOWBIT_NORM_FWD_VARIANT: " + error);
  }
  if (a.amax != nullptr) {
    LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(a.amax, 0, sizeof(float), stream), kOp,
                                      "cudaMemsetAsync"));
  }
  if (a.rows == 0) return Status::Ok();
  if (a.rows > (int64_t(1) << 31) - 2 * kMaxSpan) {  // the kernel's 32-bit row numbers
    return Status::InvalidArgument(std::string(kOp) + ": x has " + std::to_string(a.rows) +
                                   " rows, more than the CUDA kernel supports (2^31 - 256)");
  }
  return DispatchHighPrecision(a.x_dtype, kOp, "x",
                               [&](auto tag) { return Launch<decltype(tag)>(a, tune, stream); });
}

}  // namespace lowbit
