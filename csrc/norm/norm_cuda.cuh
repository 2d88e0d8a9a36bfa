// Device helpers shared by the normalization kernels (norm_fwd.cu, norm_bwd.cu).
//
// Geometry: a row is owned by a "row group" of threads_per_row threads (a multiple of 32,
// at most 1024); each thread holds kItems elements of the row in registers as kItems /
// kVec chunks of kVec contiguous elements. Chunk j of lane l starts at element
// (j * threads_per_row + l) * kVec, so a warp's loads of one chunk are contiguous 16-byte
// vectors (kVec = 16 / sizeof(T)) or, on the unaligned path, contiguous scalars (kVec = 1).
// A block holds one or more row groups; every thread of a block runs the same number of
// row iterations (rows past the end are masked), so the block-wide barriers inside
// RowSum are uniform.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/cuda_check.h"
#include "common/element.h"
#include "common/reduce.cuh"
#include "norm/norm.h"
#include "norm/norm_plan.h"

namespace lowbit {
namespace norm_cuda {

template <typename T, int N>
struct alignas(sizeof(T) * N > 16 ? 16 : sizeof(T) * N) Pack {
  T v[N];
};

// Sums N values over each row group of the block (warps_per_row warps); every thread of
// the block must call it; every thread gets its row group's sums. Fixed order.
template <int N>
__device__ __forceinline__ void RowSum(float (&v)[N], int warps_per_row) {
  __shared__ float partial[32][N];
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = WarpSum(v[k]);
  if (warps_per_row == 1) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // the previous call's readers are done with `partial`
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) partial[warp][k] = v[k];
  }
  __syncthreads();
  const int first = warp - warp % warps_per_row;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float s = 0.0f;
    for (int i = 0; i < warps_per_row; ++i) s += partial[first + i][k];
    v[k] = s;
  }
}

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

inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// RowGeometry and ChooseGeometry live in norm_plan.h (host-only: the backward workspace
// size depends on them).

inline int SmCount() {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  return sms;
}

// Register budget: 16-item kernels keep up to 4 x 16 fp32 arrays live and would spill
// under a 1024-thread launch bound (64 registers), so they are built twice: for blocks of
// at most 512 threads (128 registers) and, "wide", for the 1024-thread rows of hidden >
// 8192 (bf16) where a little spilling is accepted. 4- and 8-item kernels allow 1024.
template <int kItems, bool kWide>
constexpr int MaxBlockThreads() {
  return kItems < 16 || kWide ? 1024 : 512;
}

inline int MaxBlockThreads(const RowGeometry& g) {
  return g.items < 16 || g.threads_per_row > 512 ? 1024 : 512;
}

// Calls fn(integral_constant<int, items>, bool_constant<vectorized>, bool_constant<wide>)
// for the kernel instantiation of a geometry; items below the vector width do not exist.
template <int kVecWidth, typename Fn>
Status DispatchGeometry(const RowGeometry& g, const char* op, Fn&& fn) {
  using std::integral_constant;
  using std::false_type;
  using std::true_type;
  const bool wide = g.threads_per_row > 512;
  if (g.vectorized) {
    switch (g.items) {
      case 4:
        if constexpr (kVecWidth <= 4) return fn(integral_constant<int, 4>{}, true_type{}, false_type{});
        break;
      case 8: return fn(integral_constant<int, 8>{}, true_type{}, false_type{});
      case 16:
        return wide ? fn(integral_constant<int, 16>{}, true_type{}, true_type{})
                    : fn(integral_constant<int, 16>{}, true_type{}, false_type{});
    }
  } else {
    switch (g.items) {
      case 4: return fn(integral_constant<int, 4>{}, false_type{}, false_type{});
      case 8: return fn(integral_constant<int, 8>{}, false_type{}, false_type{});
      case 16:
        return wide ? fn(integral_constant<int, 16>{}, false_type{}, true_type{})
                    : fn(integral_constant<int, 16>{}, false_type{}, false_type{});
    }
  }
  return Status::Internal(std::string(op) + ": no kernel for " + std::to_string(g.items) +
                          " items per thread");
}

}  // namespace norm_cuda
}  // namespace lowbit
