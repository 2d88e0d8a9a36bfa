// Device helpers shared by the normalization kernels (norm_fwd_kernel.cuh, norm_bwd.cu).
//
// Geometry: a row is owned by a "row group" of threads_per_row threads (a multiple of 32,
// at most 1024); each thread holds kItems elements of the row in registers as kItems /
// kVec chunks of kVec contiguous elements. Chunk j of lane l starts at element
// (j * threads_per_row + l) * kVec, so a warp's loads of one chunk are contiguous 16-byte
// vectors (kVec = 16 / sizeof(T)) or, on the unaligned path, contiguous scalars (kVec = 1).
// A block holds one or more row groups; every thread of a row group runs the same number
// of row iterations (rows past the end are masked), so the group's barriers (RowGroupSum)
// are uniform. Raw chunks (RawChunk) keep 2-byte elements packed in pairs, converted where
// used; the forward stages prefetched rows in shared memory with cp.async (CpAsync16).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "activation/half_cvt.cuh"
#include "common/cuda_check.h"
#include "common/element.h"
#include "common/reduce.cuh"
#include "norm/norm.h"
#include "norm/norm_math.h"
#include "norm/norm_plan.h"
#include "quantize/fp8_cvt.cuh"

namespace lowbit {
namespace norm_cuda {

template <typename T, int N>
struct alignas(sizeof(T) * N > 16 ? 16 : sizeof(T) * N) Pack {
  T v[N];
};

// gamma (or beta) as fp32: f32 storage, or the storage of x (Tag).
template <typename Tag, int kVec>
__device__ __forceinline__ void LoadParamChunk(const void* p, bool is_f32, int64_t e,
                                               float (&out)[kVec]) {
  if (is_f32) {
    const auto pack = *reinterpret_cast<const Pack<float, kVec>*>(static_cast<const float*>(p) + e);
#pragma unroll
    for (int k = 0; k < kVec; ++k) out[k] = pack.v[k];
  } else {
    using T = typename Tag::Storage;
    const auto pack = *reinterpret_cast<const Pack<T, kVec>*>(static_cast<const T*>(p) + e);
#pragma unroll
    for (int k = 0; k < kVec; ++k) out[k] = LoadAsFloat(Tag{}, pack.v[k]);
  }
}

template <typename Tag, int kVec>
__device__ __forceinline__ void LoadChunk(const typename Tag::Storage* p, float (&out)[kVec]) {
  const auto pack = *reinterpret_cast<const Pack<typename Tag::Storage, kVec>*>(p);
#pragma unroll
  for (int k = 0; k < kVec; ++k) out[k] = LoadAsFloat(Tag{}, pack.v[k]);
}

template <typename Tag, int kVec>
__device__ __forceinline__ void StoreChunk(typename Tag::Storage* p, const float (&in)[kVec]) {
  Pack<typename Tag::Storage, kVec> pack;
#pragma unroll
  for (int k = 0; k < kVec; ++k) pack.v[k] = StoreFromFloat(Tag{}, in[k]);
  *reinterpret_cast<Pack<typename Tag::Storage, kVec>*>(p) = pack;
}

// x as fp32 with the hardware conversion for f16 (exact, like Fp16ToFloat, for every
// non-NaN; a NaN x only reaches outputs through fp32 arithmetic, whose NaN is canonical).
__device__ __forceinline__ float ToFloatFast(F32, float v) { return v; }
__device__ __forceinline__ float ToFloatFast(BF16, uint16_t v) { return Bf16ToFloat(v); }
__device__ __forceinline__ float ToFloatFast(F16, uint16_t v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
  return f;
}

// A raw chunk of kVec elements of T as loaded (16 bytes on the vectorized path): 2-byte
// elements stay packed in pairs in 32-bit words and are unpacked where used, so a chunk
// of 8 bf16/f16 takes 4 registers (a uint16_t array would take one register per element).
template <typename T, int kVec>
struct RawChunk {
  static constexpr bool kPairs = sizeof(T) == 2 && kVec % 2 == 0;
  using Words = std::conditional_t<kPairs, Pack<uint32_t, kPairs ? kVec / 2 : 1>, Pack<T, kVec>>;
  Words w;
};

template <typename T, int kVec>
__device__ __forceinline__ void LoadRaw(const T* src, RawChunk<T, kVec>& c) {
  c.w = *reinterpret_cast<const typename RawChunk<T, kVec>::Words*>(src);
}

template <typename T, int kVec>
__device__ __forceinline__ void ZeroRaw(RawChunk<T, kVec>& c) {
  for (auto& v : c.w.v) v = 0;
}

// Element k of a raw chunk as fp32 (bit-exact: bf16 by shifting, f16 by cvt.f32.f16).
template <typename Tag, int kVec>
__device__ __forceinline__ float RawToFloat(const RawChunk<typename Tag::Storage, kVec>& c, int k) {
  using T = typename Tag::Storage;
  if constexpr (RawChunk<T, kVec>::kPairs) {
    const uint32_t w = c.w.v[k / 2];
    if constexpr (std::is_same_v<Tag, BF16>) {
      return __uint_as_float(k % 2 == 0 ? w << 16 : w & 0xFFFF0000u);
    } else {
      float f;
      if (k % 2 == 0) {
        asm("{.reg .f16 lo, hi; mov.b32 {lo, hi}, %1; cvt.f32.f16 %0, lo;}" : "=f"(f) : "r"(w));
      } else {
        asm("{.reg .f16 lo, hi; mov.b32 {lo, hi}, %1; cvt.f32.f16 %0, hi;}" : "=f"(f) : "r"(w));
      }
      return f;
    }
  } else {
    return ToFloatFast(Tag{}, c.w.v[k]);
  }
}

// cp.async (sm_80+): 16 bytes global -> shared, completed by CpAsyncWait. The forward pass
// stages the rows it prefetches in shared memory this way, so rows in flight cost no
// registers. Each thread reads back only the chunks it copied itself, so the wait alone
// orders them (no barrier). Older architectures copy synchronously.
__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}

// `smem_dst`: a shared-window address (SharedAddress), 16-byte aligned.
__device__ __forceinline__ void CpAsync16(uint32_t smem_dst, const void* gmem_src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_dst), "l"(gmem_src) : "memory");
#else
  const uint4 v = *static_cast<const uint4*>(gmem_src);
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(smem_dst), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w) : "memory");
#endif
}

__device__ __forceinline__ uint4 LoadShared16(uint32_t smem_src) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(smem_src) : "memory");
  return v;
}

__device__ __forceinline__ void CpAsyncCommit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Waits until at most n (0..3) of this thread's committed groups are pending.
__device__ __forceinline__ void CpAsyncWait(int n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (n == 2) {
    asm volatile("cp.async.wait_group 2;" ::: "memory");
  } else if (n == 1) {
    asm volatile("cp.async.wait_group 1;" ::: "memory");
  } else if (n == 0) {
    asm volatile("cp.async.wait_group 0;" ::: "memory");
  } else {
    asm volatile("cp.async.wait_group 3;" ::: "memory");
  }
#endif
}

// Stores kVec values of y; `no_nan`: none is NaN, so the hardware conversion of
// half_cvt.cuh's PackChunk gives the codecs' bits (it falls back to them otherwise).
template <typename Tag, int kVec>
__device__ __forceinline__ void StoreChunkFast(typename Tag::Storage* p, const float (&in)[kVec],
                                               bool no_nan) {
  using T = typename Tag::Storage;
  if constexpr (sizeof(T) == 2 && kVec * sizeof(T) == 16) {
    *reinterpret_cast<uint4*>(p) = PackChunk<Tag, kVec>(in, no_nan);
  } else {
    StoreChunk<Tag, kVec>(p, in);
  }
}

// FP8 codes of v * scale (Fp32Mul: the product of NormQuantize), packed little-endian into
// 32-bit words (kVec a multiple of 4) or bytes. `hw_ok`: scale is finite and non-zero and no v
// is NaN, so no product is NaN and cvt.rn.satfinite gives the FloatToE4m3/E5m2 bits (sm_89+:
// fp8_cvt.cuh's CvtPair and CvtQuad, the conversion the quantize kernels rely on too).
__device__ __forceinline__ uint32_t CvtFp8PairHw(bool e5m2, float lo, float hi) {
#if LOWBIT_HAS_CVT_FP8X2
  return e5m2 ? CvtPair(E5m2Fmt{}, lo, hi) : CvtPair(E4m3Fmt{}, lo, hi);
#else
  return uint32_t(NormQuantize(lo, 1.0f, e5m2)) | (uint32_t(NormQuantize(hi, 1.0f, e5m2)) << 8);
#endif
}

// Four FP8 codes (a, b, c, d: bytes 0..3) of one format (kE5m2) as one 32-bit word (CvtQuad;
// `hw_ok` callers only).
template <bool kE5m2>
__device__ __forceinline__ uint32_t CvtFp8QuadHw(float a, float b, float c, float d) {
#if LOWBIT_HAS_CVT_FP8X2
  return CvtQuad(std::conditional_t<kE5m2, E5m2Fmt, E4m3Fmt>{}, a, b, c, d);
#else
  return CvtFp8PairHw(kE5m2, a, b) | (CvtFp8PairHw(kE5m2, c, d) << 16);
#endif
}

template <int kVec>
__device__ __forceinline__ void EncodeFp8(const float (&y)[kVec], float scale, bool e5m2,
                                          bool hw_ok, uint8_t (&q)[kVec]) {
  if constexpr (kVec % 2 == 0) {
    if (LOWBIT_HAS_CVT_FP8X2 && hw_ok) {
#pragma unroll
      for (int k = 0; k < kVec; k += 2) {
        const uint32_t pair = CvtFp8PairHw(e5m2, Fp32Mul(y[k], scale), Fp32Mul(y[k + 1], scale));
        q[k] = uint8_t(pair);
        q[k + 1] = uint8_t(pair >> 8);
      }
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < kVec; ++k) q[k] = NormQuantize(y[k], scale, e5m2);
}

// Barrier over the threads of one row group: bar.sync 1 + group (0 is __syncthreads) when
// a block holds several groups, else the block barrier. At most 15 groups per block.
__device__ __forceinline__ void RowGroupBarrier(int group, int groups, int threads_per_row) {
  if (groups == 1) {
    __syncthreads();
  } else {
    asm volatile("bar.sync %0, %1;" ::"r"(group + 1), "r"(threads_per_row) : "memory");
  }
}

// Sums v over one row group (warps_per_row warps): a warp tree, then (several warps) the
// warp sums through `partial` (one slot per warp of the block) and one more warp tree over
// them in warp order; every thread of the group gets the sum. Fixed order, so
// deterministic. One barrier per call: callers alternate two `partial` buffers so a buffer
// is rewritten only after the barrier of the other one, when every reader is done.
// The second tree: with a power of two of warps below 32, log2(warps) butterfly levels over
// the warp sums (each lane reads slot lane % warps) after adding +0 once: the same values as
// a 32-lane WarpSum over the warp sums and zeros (whose zero levels only add +0), with 2 (8
// warps, hidden 4096) or 1 (16 warps) fewer shuffles on the row's critical path.
__device__ __forceinline__ float RowGroupSum(float v, float* partial, int group, int groups,
                                             int threads_per_row) {
  v = WarpSum(v);
  const int warps_per_row = threads_per_row >> 5;
  if (warps_per_row == 1) return v;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) partial[warp] = v;
  RowGroupBarrier(group, groups, threads_per_row);
  const int first = group * warps_per_row;
  if (warps_per_row < 32 && (warps_per_row & (warps_per_row - 1)) == 0) {
    float w = partial[first + (lane & (warps_per_row - 1))] + 0.0f;
    for (int offset = warps_per_row >> 1; offset > 0; offset >>= 1) {
      w += __shfl_xor_sync(0xFFFFFFFFu, w, offset);
    }
    return w;
  }
  return WarpSum(lane < warps_per_row ? partial[first + lane] : 0.0f);
}

inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// RowGeometry and ChooseRowGeometry live in norm_plan.h (host-only: the backward workspace
// size depends on them).

// Readies `kernel` (the exact instantiation that will be launched) for `threads` threads and
// `dynamic_smem` bytes of dynamic shared memory and returns in *per_sm the blocks that fit
// on one SM. A block whose static + dynamic shared memory exceeds 48 KB needs the opt-in
// (cudaFuncAttributeMaxDynamicSharedMemorySize, up to cudaDevAttrMaxSharedMemoryPerBlockOptin
// minus the static bytes), set here on every call before the occupancy query (which
// otherwise reports 0 blocks). Errors name the threads, the bytes and the registers.
template <typename Kernel>
Status PrepareLaunch(Kernel* kernel, int threads, size_t dynamic_smem, const char* op,
                     int* per_sm) {
  int device = 0, optin = 48 * 1024;
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), op, "cudaGetDevice"));
  LOWBIT_RETURN_IF_ERROR(CudaStatus(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), op,
      "cudaDeviceGetAttribute"));
  cudaFuncAttributes attr{};
  LOWBIT_RETURN_IF_ERROR(
      CudaStatus(cudaFuncGetAttributes(&attr, kernel), op, "cudaFuncGetAttributes"));
  auto describe = [&]() {
    return std::to_string(threads) + " threads, " + std::to_string(dynamic_smem) + " + " +
           std::to_string(attr.sharedSizeBytes) + " (static) bytes of shared memory of " +
           std::to_string(optin) + ", " + std::to_string(attr.numRegs) + " registers";
  };
  if (threads > attr.maxThreadsPerBlock || dynamic_smem + attr.sharedSizeBytes > size_t(optin)) {
    return Status::Internal(std::string(op) + ": kernel does not fit on an SM (" + describe() + ")");
  }
  // The size depends on the hidden size and the tile: raise-only (cuda_check.h).
  LOWBIT_RETURN_IF_ERROR(RaiseDynamicSmemLimit(kernel, int(dynamic_smem), op));
  LOWBIT_RETURN_IF_ERROR(CudaStatus(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, kernel, threads, dynamic_smem), op,
      "cudaOccupancyMaxActiveBlocksPerMultiprocessor"));
  if (*per_sm < 1) {
    return Status::Internal(std::string(op) + ": kernel does not fit on an SM (" + describe() + ")");
  }
  return Status::Ok();
}

// Calls fn(integral_constant<int, items>, bool_constant<vectorized>) for the kernel
// instantiation of a geometry; items below the vector width do not exist.
template <int kVecWidth, typename Fn>
Status DispatchGeometry(const RowGeometry& g, const char* op, Fn&& fn) {
  using std::integral_constant;
  using std::false_type;
  using std::true_type;
  if (g.vectorized) {
    switch (g.items) {
      case 4:
        if constexpr (kVecWidth <= 4) return fn(integral_constant<int, 4>{}, true_type{});
        break;
      case 8: return fn(integral_constant<int, 8>{}, true_type{});
      case 16: return fn(integral_constant<int, 16>{}, true_type{});
    }
  } else {
    switch (g.items) {
      case 4: return fn(integral_constant<int, 4>{}, false_type{});
      case 8: return fn(integral_constant<int, 8>{}, false_type{});
      case 16: return fn(integral_constant<int, 16>{}, false_type{});
    }
  }
  return Status::Internal(std::string(op) + ": no kernel for " + std::to_string(g.items) +
                          " items per thread");
}

}  // namespace norm_cuda
}  // namespace lowbit
