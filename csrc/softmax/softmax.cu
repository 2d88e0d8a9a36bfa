// CUDA fused softmax forward and backward (semantics and limits: softmax.h).
//
// A row of k elements is owned by a "row group" of threads_per_row threads (a multiple of
// 32, at most 256); each thread keeps kChunks chunks of kVec contiguous elements in
// registers (kVec = 16 / sizeof(T) on the 16-byte vector path, else 1), chunk c of lane l
// starting at element (c * threads_per_row + l) * kVec, so a warp's loads are contiguous.
// One read and one write of the data (plus the mask bytes), no workspace.
// Row max and sums: warp butterflies; a row group of several warps is a whole block and
// adds its warp partials in a fixed order through shared memory, so a block barrier never
// waits for another row; one-warp groups (8 to a block) use shuffles only. Row groups
// stride over the rows independently.
// Per element the forward costs one exp (FMAs only: LbExpNegAbs of z - m <= 0, which is
// LbExpNonPositive's bits, the reference's, minus one clamp; activation_math.h) and one
// multiply by the row's reciprocal 1 / sum (one IEEE division per row). The fusion type is a template
// parameter (no per-element mask/causal tests in the scaled kernel); the 16-bit types
// convert by hardware (half_cvt.cuh; NaN bits are not promised: softmax.h).
//
// Elements per thread (the geometry) come from the launcher: the forward keeps up to 32
// elements per thread, the backward (two inputs in registers) the fewest that fit 256
// threads. LOWBIT_SOFTMAX_VARIANT (a benchmark tuning knob, read at every launch) picks
// another geometry: 1 = 16 (fwd) / 16 (bwd) elements per thread, 2 = 64 / 32, 3 = the
// default's; the backward's 0 and 3 are the same. Every variant computes the same values up
// to the summation order (tests/test_softmax_ops.py runs all). A forward with one warp per
// row and the next row's loads in flight during this row's math was tried and measured
// slower (H100, 4x32x2048x2048 bf16: 826 us against the default's 788 us).
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "activation/activation_math.h"  // LbExpNegAbs
#include "activation/half_cvt.cuh"
#include "common/cuda_check.h"
#include "common/element.h"
#include "common/fp32_math.h"
#include "softmax/softmax.h"

namespace lowbit {
namespace {

constexpr int kSoftmaxThreads = 256;  // threads per block; kSoftmaxCudaMaxK needs 256 x 64
constexpr int kMaxWarps = kSoftmaxThreads / 32;

template <typename T>
struct SoftmaxKernelArgs {
  float scale;
  int64_t rows, q, heads_q, mask_batch;
  int k;
  const T* x;  // forward: x; backward: dy
  const T* y;  // backward: the forward output
  const uint8_t* mask;
  T* out;
  int threads_per_row;
};

struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  __device__ float operator()(float a, float b) const { return __fadd_rn(a, b); }
};

// Reduces v over the row group of `warps` warps (every thread of the group calls it; with
// warps > 1 the group is the block). A `slots` array may be rewritten only after every
// thread has passed a later barrier (the callers alternate two arrays).
template <typename Op>
__device__ __forceinline__ float RowReduce(float v, float* slots, int warps, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  if (warps == 1) return v;
  if ((threadIdx.x & 31) == 0) slots[threadIdx.x >> 5] = v;
  __syncthreads();
  v = slots[0];
  for (int i = 1; i < warps; ++i) v = op(v, slots[i]);
  return v;
}

template <typename T, int kVec>
__device__ __forceinline__ void LoadVec(const T* src, T (&dst)[kVec]) {
  if constexpr (kVec == 1) {
    dst[0] = src[0];
  } else {
    const uint4 packed = __ldg(reinterpret_cast<const uint4*>(src));
    memcpy(dst, &packed, sizeof(packed));
  }
}

template <typename Tag, int kVec>
__device__ __forceinline__ void StoreVec(typename Tag::Storage* dst, const float (&v)[kVec]) {
  if constexpr (kVec == 1) {
    dst[0] = StoreFromFloat(Tag{}, v[0]);
  } else {
    *reinterpret_cast<uint4*>(dst) = PackChunk<Tag, kVec>(v, true);
  }
}

template <typename Tag, int kChunks, int kVec, SoftmaxType kType>
__global__ void __launch_bounds__(kSoftmaxThreads) SoftmaxForwardKernel(SoftmaxKernelArgs<typename Tag::Storage> p) {
  using T = typename Tag::Storage;
  __shared__ float slots[2][kMaxWarps];
  const int tpr = p.threads_per_row, warps = tpr >> 5;
  const int groups = blockDim.x / tpr;
  const int group = threadIdx.x / tpr, lane = threadIdx.x % tpr;
  for (int64_t row = int64_t(blockIdx.x) * groups + group; row < p.rows; row += int64_t(gridDim.x) * groups) {
    const T* src = p.x + row * p.k;
    int64_t i = 0;  // the query index (masked, causal)
    const uint8_t* mask = nullptr;
    if constexpr (kType != SoftmaxType::kScaled) i = row % p.q;
    if constexpr (kType == SoftmaxType::kScaledMasked) {
      mask = p.mask + ((p.mask_batch == 1 ? 0 : row / p.heads_q) * p.q + i) * p.k;
    }
    float v[kChunks][kVec];
    float m = -INFINITY;
    T raw[kChunks][kVec];  // every load issued before the first use (none waits on another)
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int e = (c * tpr + lane) * kVec;
      if (e < p.k) LoadVec<T, kVec>(src + e, raw[c]);
    }
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int e = (c * tpr + lane) * kVec;
      const bool ok = e < p.k;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        float z = ok ? __fmul_rn(LoadElement(Tag{}, raw[c][j]), p.scale) : -INFINITY;
        if constexpr (kType == SoftmaxType::kScaledMasked) {
          if (ok && mask[e + j] == 1) z = -10000.0f;
        }
        if constexpr (kType == SoftmaxType::kScaledUpperTriang) {
          if (e + j > i) z = -INFINITY;
        }
        v[c][j] = z;
        m = fmaxf(m, z);
      }
    }
    m = RowReduce(m, slots[0], warps, MaxOp{});
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        v[c][j] = LbExpNegAbs(__fadd_rn(v[c][j], -m));  // = LbExpNonPositive: the argument is <= 0
        sum = __fadd_rn(sum, v[c][j]);
      }
    }
    sum = RowReduce(sum, slots[1], warps, SumOp{});
    const float inv_sum = __fdiv_rn(1.0f, sum);  // once per row; the reference does the same
    const bool zero_row = kType == SoftmaxType::kScaledMasked && m == -10000.0f;  // fully masked
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int e = (c * tpr + lane) * kVec;
      if (e >= p.k) continue;
      float out[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) out[j] = zero_row ? 0.0f : __fmul_rn(v[c][j], inv_sum);
      StoreVec<Tag, kVec>(p.out + row * p.k + e, out);
    }
  }
}

template <typename Tag, int kChunks, int kVec>
__global__ void __launch_bounds__(kSoftmaxThreads) SoftmaxBackwardKernel(SoftmaxKernelArgs<typename Tag::Storage> p) {
  using T = typename Tag::Storage;
  __shared__ float slots[2][kMaxWarps];
  const int tpr = p.threads_per_row, warps = tpr >> 5;
  const int groups = blockDim.x / tpr;
  const int group = threadIdx.x / tpr, lane = threadIdx.x % tpr;
  int parity = 0;
  for (int64_t row = int64_t(blockIdx.x) * groups + group; row < p.rows; row += int64_t(gridDim.x) * groups) {
    const T* dysrc = p.x + row * p.k;
    const T* ysrc = p.y + row * p.k;
    float yv[kChunks][kVec], v[kChunks][kVec];
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int e = (c * tpr + lane) * kVec;
      T raw_dy[kVec], raw_y[kVec];
      const bool ok = e < p.k;
      if (ok) {
        LoadVec<T, kVec>(dysrc + e, raw_dy);
        LoadVec<T, kVec>(ysrc + e, raw_y);
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        yv[c][j] = ok ? LoadElement(Tag{}, raw_y[j]) : 0.0f;
        v[c][j] = ok ? __fmul_rn(yv[c][j], LoadElement(Tag{}, raw_dy[j])) : 0.0f;
        sum = __fadd_rn(sum, v[c][j]);
      }
    }
    sum = RowReduce(sum, slots[parity], warps, SumOp{});
    parity ^= 1;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int e = (c * tpr + lane) * kVec;
      if (e >= p.k) continue;
      float out[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) out[j] = __fmul_rn(p.scale, __fadd_rn(v[c][j], -__fmul_rn(yv[c][j], sum)));
      StoreVec<Tag, kVec>(p.out + row * p.k + e, out);
    }
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename Tag, int kChunks, int kVec, bool kBackward>
void LaunchKernel(SoftmaxType type, const SoftmaxKernelArgs<typename Tag::Storage>& p, int block, int grid,
                  GpuStream stream) {
  if constexpr (kBackward) {
    SoftmaxBackwardKernel<Tag, kChunks, kVec><<<grid, block, 0, stream>>>(p);
  } else if (type == SoftmaxType::kScaledMasked) {
    SoftmaxForwardKernel<Tag, kChunks, kVec, SoftmaxType::kScaledMasked><<<grid, block, 0, stream>>>(p);
  } else if (type == SoftmaxType::kScaledUpperTriang) {
    SoftmaxForwardKernel<Tag, kChunks, kVec, SoftmaxType::kScaledUpperTriang><<<grid, block, 0, stream>>>(p);
  } else {
    SoftmaxForwardKernel<Tag, kChunks, kVec, SoftmaxType::kScaled><<<grid, block, 0, stream>>>(p);
  }
}

// Calls the kernel instantiation with `chunks` chunks per thread (at most 64 elements).
template <typename Tag, int kVec, bool kBackward, int kChunks = 1>
Status LaunchChunks(int chunks, SoftmaxType type, const SoftmaxKernelArgs<typename Tag::Storage>& p, int block,
                    int grid, GpuStream stream) {
  if constexpr (kChunks * kVec <= 64) {
    if (chunks == kChunks) {
      LaunchKernel<Tag, kChunks, kVec, kBackward>(type, p, block, grid, stream);
      return Status::Ok();
    }
    return LaunchChunks<Tag, kVec, kBackward, kChunks * 2>(chunks, type, p, block, grid, stream);
  } else {
    return Status::Internal("softmax: no kernel for " + std::to_string(chunks) + " chunks per thread");
  }
}

// LOWBIT_SOFTMAX_VARIANT: 0 (unset) default, 1, 2, 3 (file preamble). -1 if invalid.
int SoftmaxVariant() {
  const char* env = std::getenv("LOWBIT_SOFTMAX_VARIANT");
  if (env == nullptr || env[0] == '\0') return 0;
  if (env[0] >= '0' && env[0] <= '3' && env[1] == '\0') return env[0] - '0';
  return -1;
}

template <typename Tag, bool kBackward>
Status Launch(const SoftmaxArgs& a, GpuStream stream, const char* op) {
  using T = typename Tag::Storage;
  const int variant = SoftmaxVariant();
  if (variant < 0) {
    return Status::InvalidArgument(std::string(op) + ": LOWBIT_SOFTMAX_VARIANT: expected 0, 1, 2 or 3, got '" +
                                   std::getenv("LOWBIT_SOFTMAX_VARIANT") + "'");
  }
  SoftmaxKernelArgs<T> p;
  p.scale = a.scale;
  p.rows = a.batch * a.heads * a.q;
  p.q = a.q;
  p.k = int(a.k);  // <= kSoftmaxCudaMaxK
  p.heads_q = a.heads * a.q;
  p.mask_batch = a.mask_batch;
  p.x = static_cast<const T*>(kBackward ? a.dy : a.x);
  p.y = static_cast<const T*>(a.y_in);
  p.mask = a.mask;
  p.out = static_cast<T*>(a.out);
  constexpr int kVec = 16 / int(sizeof(T));
  const bool vec = a.k % kVec == 0 && Aligned16(p.x) && Aligned16(p.y) && Aligned16(p.out);
  const int vec_width = vec ? kVec : 1;
  const int64_t row_chunks = (a.k + vec_width - 1) / vec_width;
  const int max_chunks = 64 / vec_width;
  // Chunks per thread: the fewest that give each thread at least target_elems elements
  // (or let one warp hold the row), more only where a row would need over kSoftmaxThreads
  // threads. Rows are owned by 32 .. kSoftmaxThreads threads; a block is one row group of
  // several warps, or 8 one-warp groups.
  static constexpr int kFwdTarget[4] = {32, 16, 64, 32};
  static constexpr int kBwdTarget[4] = {1, 16, 32, 1};
  const int target_elems = kBackward ? kBwdTarget[variant] : kFwdTarget[variant];
  int chunks = 0, tpr = 0;
  for (int c = 1; c <= max_chunks; c *= 2) {
    const int64_t t = ((row_chunks + c - 1) / c + 31) / 32 * 32;
    if (t <= kSoftmaxThreads && (t == 32 || c * vec_width >= target_elems || c == max_chunks)) {
      chunks = c, tpr = int(t);
      break;
    }
  }
  if (chunks == 0) {
    return Status::InvalidArgument(std::string(op) + ": k = " + std::to_string(a.k) +
                                   " exceeds the CUDA kernel's limit of " + std::to_string(kSoftmaxCudaMaxK));
  }
  p.threads_per_row = tpr;
  const int block = tpr == 32 ? kSoftmaxThreads : tpr;
  const int64_t groups = (p.rows + block / tpr - 1) / (block / tpr);
  const int grid = GridStrideBlocks(groups * block, block, 2048 / block);
  const Status s = vec ? LaunchChunks<Tag, kVec, kBackward>(chunks, a.type, p, block, grid, stream)
                       : LaunchChunks<Tag, 1, kBackward>(chunks, a.type, p, block, grid, stream);
  LOWBIT_RETURN_IF_ERROR(s);
  return LaunchStatus(op);
}

template <bool kBackward>
Status Run(const SoftmaxArgs& a, GpuStream stream) {
  const char* op = kBackward ? "lowbit_softmax_backward" : "lowbit_softmax_forward";
  if (a.k > kSoftmaxCudaMaxK) {
    return Status::InvalidArgument(std::string(op) + ": k = " + std::to_string(a.k) +
                                   " exceeds the CUDA kernel's limit of " + std::to_string(kSoftmaxCudaMaxK));
  }
  if (a.batch * a.heads * a.q == 0 || a.k == 0) return Status::Ok();
  return DispatchHighPrecision(a.dtype, op, kBackward ? "dy" : "x", [&](auto tag) {
    return Launch<decltype(tag), kBackward>(a, stream, op);
  });
}

}  // namespace

Status SoftmaxForwardCuda(const SoftmaxArgs& a, GpuStream stream) { return Run<false>(a, stream); }
Status SoftmaxBackwardCuda(const SoftmaxArgs& a, GpuStream stream) { return Run<true>(a, stream); }

}  // namespace lowbit
