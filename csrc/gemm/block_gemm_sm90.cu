// block_gemm_sm90: the FP8 block-scaled GEMM of block_gemm_sm90.h on Hopper's wgmma and TMA.
//
// Persistent clusters of two CTAs (one CTA per SM) walk pairs of vertically adjacent 128x192
// output tiles, grouped 8 pairs of tile rows at a time so the clusters running together share
// operand tiles in L2 (LOWBIT_BLOCK_GEMM_GROUP changes the order: ParseRasterGroup). Warpgroup 0 is the producer: one thread streams each 128-long K block
// of its a tile (128 x 128 bytes) and of the pair's shared b tile (192 x 128 bytes), both
// 128B-swizzled, with TMA into a 5-stage shared-memory ring, with the block's scales (a 1x128
// operand's 128 or 192 values; a 128x128 operand's one value in its 16-byte group, for b the
// two groups of the two 128-row scale blocks a 192-wide tile can span), signalling a "full"
// mbarrier per stage. Each CTA of the pair loads half of the b tile and multicasts it into
// both, so b costs each CTA half the L2 traffic; a stage is refilled only when the consumer
// warps of both CTAs have released it. Warpgroups 1 and 2 each own 64 rows of the tile: per K
// block they run four m64n192k32 wgmmas into a fresh fp32 partial sum, wait for them, release
// the stage, wait for the next one and read its scales, then multiply the partial by the
// block's two scales into the running fp32 total (the "promotion" of block_gemm_sm90.h's
// numerics). While one warpgroup promotes, the other's wgmmas keep the tensor cores busy,
// so everything else is kept off that stretch: descriptors and addresses are bases plus
// counters in uniform registers, no global loads, the scale products of a 128x128 b are
// formed once per block, and setmaxnreg hands the producer's registers to the consumers. The
// epilogue adds the bias in fp32 and stores pairs of outputs straight from the accumulator
// registers, while the producer already loads the next tile. (128x192 tiles measured 1030
// TFLOP/s over the seed Dense's GEMMs against 904-930 for 128x128 ones: a third more MMA work
// per promotion and per byte of a.)
//
// Device code exists for sm_90a only (wgmma needs the arch-specific target); other targets
// compile an empty kernel that the host side never launches (BlockGemmSm90Applies).
//
// Pieces (included here, private to this translation unit): block_gemm_sm90_config.cuh
// (tile and shared-memory sizes, Params), block_gemm_sm90_ptx.cuh (inline-PTX wrappers) and
// block_gemm_sm90_kernel.cuh (BlockGemmKernel and its producer and consumers); this file
// keeps the host side (TMA descriptors, raster order, launch and dispatch).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/cuda_check.h"
#include "gemm/block_gemm_sm90.h"

// This file's pieces (see the preamble), after everything they use.
#include "gemm/block_gemm_sm90_config.cuh"
#include "gemm/block_gemm_sm90_kernel.cuh"

namespace lowbit {
namespace {

// ---------------------------------------------------------------- host side

PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();  // reported by EncodeMap; not the next launch's error
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A 2-D TMA descriptor: `rows` x `cols` elements of `elem_bytes`, rows `ld` elements apart,
// copied in boxes of box_rows x box_cols.
Status EncodeMap(CUtensorMap* map, const void* base, CUtensorMapDataType type, int elem_bytes,
                 int64_t rows, int64_t cols, int64_t ld, int box_rows, int box_cols,
                 CUtensorMapSwizzle swizzle, const char* what) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (encode == nullptr) {
    return Status::Internal("lowbit_gemm: the driver has no cuTensorMapEncodeTiled (block GEMM)");
  }
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(ld) * elem_bytes};
  const cuuint32_t box[2] = {cuuint32_t(box_cols), cuuint32_t(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(map, type, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return Status::Internal(std::string("lowbit_gemm: cuTensorMapEncodeTiled failed for ") + what +
                            " (CUresult " + std::to_string(int(r)) + ")");
  }
  return Status::Ok();
}

// One operand's scale array (gemm.h's layout) as a TMA map. 1x128: (k_blocks, roundup(rows,
// 4)), a tile's `tile_rows` values per K block; 128x128: (row tiles, k_blocks rounded up to
// 4), 16 bytes (four K blocks' scales) at a time.
Status EncodeScaleMap(CUtensorMap* map, const void* scales, GemmScaleMode mode, int64_t rows,
                      int64_t k, int tile_rows, const char* what) {
  const GemmScaleShape d = GemmScaleDims(mode, rows, k);
  const int box_cols = mode == GemmScaleMode::kBlock1x128 ? tile_rows : 4;
  return EncodeMap(map, scales, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, d.dim0, d.dim1, d.dim1, 1,
                   box_cols, CU_TENSOR_MAP_SWIZZLE_NONE, what);
}

// The raster order (benchmark-only knob LOWBIT_BLOCK_GEMM_GROUP, read at every call): "<g>"
// walks groups of g cluster rows (2g tile rows) down M within each tile column, then the next
// column (the default, g = kGroupRows); "n<g>" walks groups of g tile columns across N within
// each cluster row instead. Only the order changes, never a tile's arithmetic.
Status ParseRasterGroup(int* group, int* n_major) {
  *group = kGroupRows;
  *n_major = 0;
  const char* env = std::getenv("LOWBIT_BLOCK_GEMM_GROUP");
  if (env == nullptr || *env == '\0') return Status::Ok();
  const int by_n = env[0] == 'n' ? 1 : 0;
  int g = 0, used = 0;
  if (std::sscanf(env + by_n, "%d%n", &g, &used) != 1 || env[by_n + used] != '\0' || g < 1 || g > 1024) {
    return Status::InvalidArgument(std::string("block_gemm_sm90: LOWBIT_BLOCK_GEMM_GROUP=\"") + env +
                                   "\": expected <g> or n<g> with g in 1..1024");
  }
  *group = g;
  *n_major = by_n;
  return Status::Ok();
}

// Benchmark-only knob LOWBIT_BLOCK_GEMM_CUBIN (read at every call): a cubin of this
// translation unit's kernels (e.g. one whose control bits tools/sass_control.py rewrote) whose
// BlockGemmKernel of the same template arguments runs in place of the built one. The
// kernel is found by its mangled name, else by the part after "BlockGemmKernel" (the
// anonymous namespace's name could differ between compilations); the launch is otherwise
// the same. Libraries stay loaded for the process.
Status OverrideKernel(const void* built, const void** chosen) {
  const char* path = std::getenv("LOWBIT_BLOCK_GEMM_CUBIN");
  if (path == nullptr || *path == '\0') return Status::Ok();
  static std::mutex mu;
  static std::map<std::string, cudaLibrary_t> libraries;
  static std::map<std::pair<std::string, const void*>, cudaKernel_t> kernels;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(std::string(path), built);
  if (auto it = kernels.find(key); it != kernels.end()) {
    *chosen = reinterpret_cast<const void*>(it->second);
    return Status::Ok();
  }
  auto lib = libraries.find(path);
  if (lib == libraries.end()) {
    cudaLibrary_t loaded = nullptr;
    LOWBIT_RETURN_IF_ERROR(CudaStatus(
        cudaLibraryLoadFromFile(&loaded, path, nullptr, nullptr, 0, nullptr, nullptr, 0),
        "lowbit_gemm", "cudaLibraryLoadFromFile (LOWBIT_BLOCK_GEMM_CUBIN)"));
    lib = libraries.emplace(path, loaded).first;
  }
  const char* name = nullptr;
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaFuncGetName(&name, built), "lowbit_gemm", "cudaFuncGetName"));
  cudaKernel_t exact = nullptr;
  if (name != nullptr && cudaLibraryGetKernel(&exact, lib->second, name) == cudaSuccess) {
    kernels.emplace(key, exact);
    *chosen = reinterpret_cast<const void*>(exact);
    return Status::Ok();
  }
  (void)cudaGetLastError();  // the miss above is not an error yet: try the other names
  const auto suffix = [](const char* n) {
    const char* at = n == nullptr ? nullptr : std::strstr(n, "BlockGemmKernel");
    return at == nullptr ? std::string() : std::string(at);
  };
  const std::string want = suffix(name);
  unsigned int count = 0;
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaLibraryGetKernelCount(&count, lib->second), "lowbit_gemm",
                                    "cudaLibraryGetKernelCount"));
  std::vector<cudaKernel_t> all(count);
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaLibraryEnumerateKernels(all.data(), count, lib->second),
                                    "lowbit_gemm", "cudaLibraryEnumerateKernels"));
  for (cudaKernel_t k : all) {
    const char* other = nullptr;
    if (cudaFuncGetName(&other, reinterpret_cast<const void*>(k)) != cudaSuccess) {
      (void)cudaGetLastError();  // a nameless kernel is no match, not the next launch's error
      continue;
    }
    if (!want.empty() && suffix(other) == want) {
      kernels.emplace(key, k);
      *chosen = reinterpret_cast<const void*>(k);
      return Status::Ok();
    }
  }
  return Status::InvalidArgument(std::string("lowbit_gemm: LOWBIT_BLOCK_GEMM_CUBIN=\"") + path +
                                 "\" has no kernel " + (name ? name : "?"));
}

template <typename OutT, bool kAVec, bool kBVec, typename ATag, typename BTag>
Status Launch(const CUtensorMap& ma, const CUtensorMap& mb, const CUtensorMap& msa,
              const CUtensorMap& msb, const Params& p, int device, GpuStream stream) {
  auto kernel = BlockGemmKernel<OutT, kAVec, kBVec, ATag, BTag>;
  LOWBIT_RETURN_IF_ERROR(CudaStatus(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes),
      "lowbit_gemm", "cudaFuncSetAttribute (block GEMM shared memory)"));
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = kCluster;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = static_cast<cudaStream_t>(stream);
  config.attrs = &cluster;
  config.numAttrs = 1;
  // As many clusters as can be resident at once (the kernel is persistent), at most one per
  // unit of work.
  int sms = 0, clusters = 0;
  LOWBIT_RETURN_IF_ERROR(CudaStatus(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "lowbit_gemm",
      "cudaDeviceGetAttribute"));
  config.gridDim = dim3(sms / kCluster * kCluster);
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config),
                                    "lowbit_gemm", "cudaOccupancyMaxActiveClusters (block GEMM)"));
  const int units = (p.m_tiles + kCluster - 1) / kCluster * p.n_tiles;
  clusters = clusters < units ? clusters : units;
  if (clusters < 1) {
    return Status::Internal("lowbit_gemm: the block GEMM kernel cannot be resident on this device");
  }
  config.gridDim = dim3(clusters * kCluster);
  const void* chosen = reinterpret_cast<const void*>(kernel);
  LOWBIT_RETURN_IF_ERROR(OverrideKernel(chosen, &chosen));
  if (chosen != reinterpret_cast<const void*>(kernel)) {
    LOWBIT_RETURN_IF_ERROR(CudaStatus(
        cudaFuncSetAttribute(chosen, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes),
        "lowbit_gemm", "cudaFuncSetAttribute (LOWBIT_BLOCK_GEMM_CUBIN)"));
  }
  void* args[] = {const_cast<CUtensorMap*>(&ma), const_cast<CUtensorMap*>(&mb),
                  const_cast<CUtensorMap*>(&msa), const_cast<CUtensorMap*>(&msb),
                  const_cast<Params*>(&p)};
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaLaunchKernelExC(&config, chosen, args), "lowbit_gemm",
                                    "cudaLaunchKernelExC (block GEMM sm90)"));
  return LaunchStatus("lowbit_gemm (block GEMM sm90)");
}

template <typename OutT, bool kAVec, bool kBVec>
Status DispatchTypes(const GemmArgs& args, const CUtensorMap& ma, const CUtensorMap& mb,
                     const CUtensorMap& msa, const CUtensorMap& msb, const Params& p, int device,
                     GpuStream stream) {
  const bool a4 = args.a_type == DType::kE4M3, b4 = args.b_type == DType::kE4M3;
  if (a4 && b4) return Launch<OutT, kAVec, kBVec, E4m3Tag, E4m3Tag>(ma, mb, msa, msb, p, device, stream);
  if (a4) return Launch<OutT, kAVec, kBVec, E4m3Tag, E5m2Tag>(ma, mb, msa, msb, p, device, stream);
  if (b4) return Launch<OutT, kAVec, kBVec, E5m2Tag, E4m3Tag>(ma, mb, msa, msb, p, device, stream);
  return Status::InvalidArgument("lowbit_gemm: E5M2 x E5M2 has no FP8 tensor-core path");
}

template <typename OutT>
Status DispatchModes(const GemmArgs& args, const CUtensorMap& ma, const CUtensorMap& mb,
                     const CUtensorMap& msa, const CUtensorMap& msb, const Params& p, int device,
                     GpuStream stream) {
  const bool av = args.a_scale_mode == GemmScaleMode::kBlock1x128;
  const bool bv = args.b_scale_mode == GemmScaleMode::kBlock1x128;
  if (av && bv) return DispatchTypes<OutT, true, true>(args, ma, mb, msa, msb, p, device, stream);
  if (av) return DispatchTypes<OutT, true, false>(args, ma, mb, msa, msb, p, device, stream);
  return DispatchTypes<OutT, false, true>(args, ma, mb, msa, msb, p, device, stream);
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

bool BlockGemmSm90Requested() {
  const char* v = std::getenv("LOWBIT_BLOCK_GEMM");
  return v != nullptr && std::strcmp(v, "wgmma") == 0;
}

bool BlockGemmSm90Applies(const GemmArgs& args, int capability) {
  const bool a_block = args.a_scale_mode == GemmScaleMode::kBlock1x128 ||
                       args.a_scale_mode == GemmScaleMode::kBlock128x128;
  const bool b_block = args.b_scale_mode == GemmScaleMode::kBlock1x128 ||
                       args.b_scale_mode == GemmScaleMode::kBlock128x128;
  const bool both_128x128 = args.a_scale_mode == GemmScaleMode::kBlock128x128 &&
                            args.b_scale_mode == GemmScaleMode::kBlock128x128;
  return capability == 90 && a_block && b_block && !both_128x128 && IsFp8(args.a_type) &&
         IsFp8(args.b_type) && !(args.a_type == DType::kE5M2 && args.b_type == DType::kE5M2) &&
         args.k % 16 == 0 && args.n % 16 == 0 && args.k > 0 && args.m > 0 &&
         args.m < (int64_t(1) << 31) && args.n < (int64_t(1) << 31) && args.k < (int64_t(1) << 31) &&
         Aligned16(args.a) && Aligned16(args.b) && Aligned16(args.a_scale_inv) &&
         Aligned16(args.b_scale_inv) && Aligned16(args.out) &&
         !(args.bias != nullptr && args.out_type == DType::kF32);
}

Status BlockGemmSm90Cuda(const GemmArgs& args, int device_ordinal, GpuStream stream) {
  const int64_t k_blocks = (args.k + kTileK - 1) / kTileK;
  CUtensorMap ma{}, mb{}, msa{}, msb{};
  LOWBIT_RETURN_IF_ERROR(EncodeMap(&ma, args.a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, args.m, args.k,
                                   args.k, kTileM, kTileK, CU_TENSOR_MAP_SWIZZLE_128B, "a"));
  LOWBIT_RETURN_IF_ERROR(EncodeMap(&mb, args.b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, args.n, args.k,
                                   args.k, kTileN / kCluster, kTileK, CU_TENSOR_MAP_SWIZZLE_128B,
                                   "b"));
  Params p{};
  LOWBIT_RETURN_IF_ERROR(EncodeScaleMap(&msa, args.a_scale_inv, args.a_scale_mode, args.m, args.k,
                                        kTileM, "a_scale_inv"));
  LOWBIT_RETURN_IF_ERROR(EncodeScaleMap(&msb, args.b_scale_inv, args.b_scale_mode, args.n, args.k,
                                        kTileN, "b_scale_inv"));
  p.bias = args.bias;
  p.out = args.out;
  p.m = int(args.m);
  p.n = int(args.n);
  p.k_blocks = int(k_blocks);
  p.m_tiles = int((args.m + kTileM - 1) / kTileM);
  p.n_tiles = int((args.n + kTileN - 1) / kTileN);
  LOWBIT_RETURN_IF_ERROR(ParseRasterGroup(&p.group_rows, &p.n_major));
  switch (args.out_type) {
    case DType::kBF16:
      return DispatchModes<__nv_bfloat16>(args, ma, mb, msa, msb, p, device_ordinal, stream);
    case DType::kF16:
      return DispatchModes<__half>(args, ma, mb, msa, msb, p, device_ordinal, stream);
    case DType::kF32:
      return DispatchModes<float>(args, ma, mb, msa, msb, p, device_ordinal, stream);
    default:
      return Status::InvalidArgument(std::string("lowbit_gemm: out: the block GEMM writes bf16, "
                                                 "f16 or f32, got ") + DTypeName(args.out_type));
  }
}

}  // namespace lowbit
