// CUDA fused softmax forward and backward (semantics and limits: softmax.h).
//
// A row of k elements is owned by a "row group" of threads_per_row threads (a multiple of
// 32, at most 1024); each thread keeps kChunks chunks of kVec contiguous elements in
// registers (kVec = 16 / sizeof(T) on the 16-byte vector path, else 1), chunk c of lane l
// starting at element (c * threads_per_row + l) * kVec, so a warp's loads are contiguous.
// Row max and sums: warp butterflies, then the row group's warps in a fixed order through
// shared memory. Every thread of a block runs the same number of row iterations (rows past
// the end are masked), so the block-wide barriers are uniform. One read and one write of
// the data (plus the mask bytes), no workspace. Per element the forward costs one
// LbExpNonPositive (FMAs only) and one multiply by the row's reciprocal 1 / sum (one IEEE
// division per row); threads keep up to 32 elements (kChunks * kVec) so the two row
// reductions are spread over many elements.
#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <type_traits>

#include "common/cuda_check.h"
#include "common/element.h"
#include "common/fp32_math.h"
#include "softmax/softmax.h"

namespace lowbit {
namespace {

constexpr int kSoftmaxThreads = 256;  // threads per block; kSoftmaxCudaMaxK needs 256 x 64

template <typename T>
struct SoftmaxKernelArgs {
  SoftmaxType type;
  float scale;
  int64_t rows, q, k, heads_q, mask_batch;
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

// Reduces v over the row group; every thread of the block must call it.
template <typename Op>
__device__ __forceinline__ float RowReduce(float v, int warps_per_row, Op op) {
  __shared__ float partial[32];
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  if (warps_per_row == 1) return v;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // the previous call's readers are done with `partial`
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int first = warp - warp % warps_per_row;
  v = partial[first];
  for (int i = 1; i < warps_per_row; ++i) v = op(v, partial[first + i]);
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

template <typename T, int kVec>
__device__ __forceinline__ void StoreVec(T* dst, const T (&src)[kVec]) {
  if constexpr (kVec == 1) {
    dst[0] = src[0];
  } else {
    uint4 packed;
    memcpy(&packed, src, sizeof(packed));
    *reinterpret_cast<uint4*>(dst) = packed;
  }
}

template <typename Tag, int kChunks, int kVec, bool kBackward>
__global__ void __launch_bounds__(kSoftmaxThreads) SoftmaxKernel(SoftmaxKernelArgs<typename Tag::Storage> p) {
  using T = typename Tag::Storage;
  const int tpr = p.threads_per_row;
  const int warps_per_row = tpr / 32;
  const int rows_per_block = blockDim.x / tpr;
  const int group = threadIdx.x / tpr, lane = threadIdx.x % tpr;
  for (int64_t base = int64_t(blockIdx.x) * rows_per_block; base < p.rows;
       base += int64_t(gridDim.x) * rows_per_block) {
    const int64_t row = base + group;
    const bool active = row < p.rows;
    const T* src = p.x + row * p.k;
    float v[kChunks][kVec];
    if constexpr (!kBackward) {
      const int64_t i = row % p.q;
      const uint8_t* mask = nullptr;
      if (p.type == SoftmaxType::kScaledMasked) {
        const int64_t b = row / p.heads_q;
        mask = p.mask + ((p.mask_batch == 1 ? 0 : b) * p.q + i) * p.k;
      }
      float m = -INFINITY;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int64_t e = (int64_t(c) * tpr + lane) * kVec;
        T raw[kVec];
        const bool ok = active && e < p.k;
        if (ok) LoadVec<T, kVec>(src + e, raw);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          float z = -INFINITY;
          if (ok) {
            z = __fmul_rn(LoadAsFloat(Tag{}, raw[j]), p.scale);
            if (mask != nullptr && mask[e + j] == 1) z = -10000.0f;
            if (p.type == SoftmaxType::kScaledUpperTriang && e + j > i) z = -INFINITY;
          }
          v[c][j] = z;
          m = fmaxf(m, z);
        }
      }
      m = RowReduce(m, warps_per_row, MaxOp{});
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          v[c][j] = LbExpNonPositive(__fadd_rn(v[c][j], -m));
          sum = __fadd_rn(sum, v[c][j]);
        }
      }
      sum = RowReduce(sum, warps_per_row, SumOp{});
      const float inv_sum = __fdiv_rn(1.0f, sum);  // once per row; the reference does the same
      const bool zero_row = mask != nullptr && m == -10000.0f;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int64_t e = (int64_t(c) * tpr + lane) * kVec;
        if (!active || e >= p.k) continue;
        T out[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) out[j] = StoreFromFloat(Tag{}, zero_row ? 0.0f : __fmul_rn(v[c][j], inv_sum));
        StoreVec<T, kVec>(p.out + row * p.k + e, out);
      }
    } else {
      const T* ysrc = p.y + row * p.k;
      float yv[kChunks][kVec];
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int64_t e = (int64_t(c) * tpr + lane) * kVec;
        T raw_dy[kVec], raw_y[kVec];
        const bool ok = active && e < p.k;
        if (ok) {
          LoadVec<T, kVec>(src + e, raw_dy);
          LoadVec<T, kVec>(ysrc + e, raw_y);
        }
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          yv[c][j] = ok ? LoadAsFloat(Tag{}, raw_y[j]) : 0.0f;
          v[c][j] = ok ? __fmul_rn(yv[c][j], LoadAsFloat(Tag{}, raw_dy[j])) : 0.0f;
          sum = __fadd_rn(sum, v[c][j]);
        }
      }
      sum = RowReduce(sum, warps_per_row, SumOp{});
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int64_t e = (int64_t(c) * tpr + lane) * kVec;
        if (!active || e >= p.k) continue;
        T out[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float g = __fadd_rn(v[c][j], -__fmul_rn(yv[c][j], sum));
          out[j] = StoreFromFloat(Tag{}, __fmul_rn(p.scale, g));
        }
        StoreVec<T, kVec>(p.out + row * p.k + e, out);
      }
    }
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Calls the kernel instantiation with `chunks` chunks per thread (at most 64 elements).
template <typename Tag, int kVec, bool kBackward, int kChunks = 1>
Status LaunchChunks(int chunks, const SoftmaxKernelArgs<typename Tag::Storage>& p, int block,
                    int grid, GpuStream stream) {
  if constexpr (kChunks * kVec <= 64) {
    if (chunks == kChunks) {
      SoftmaxKernel<Tag, kChunks, kVec, kBackward><<<grid, block, 0, stream>>>(p);
      return Status::Ok();
    }
    return LaunchChunks<Tag, kVec, kBackward, kChunks * 2>(chunks, p, block, grid, stream);
  } else {
    return Status::Internal("softmax: no kernel for " + std::to_string(chunks) + " chunks per thread");
  }
}

template <typename Tag, bool kBackward>
Status Launch(const SoftmaxArgs& a, GpuStream stream, const char* op) {
  using T = typename Tag::Storage;
  SoftmaxKernelArgs<T> p;
  p.type = a.type;
  p.scale = a.scale;
  p.rows = a.batch * a.heads * a.q;
  p.q = a.q;
  p.k = a.k;
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
  // Chunks per thread. Forward: up to 32 elements each (the fewest that make one warp per
  // row enough, else 32 / vec_width; fewer, longer row reductions), more only where a row
  // would need over kSoftmaxThreads threads. Backward (two inputs in registers, already
  // at 90% of copy bandwidth): the fewest chunks that fit kSoftmaxThreads threads. Rows
  // are owned by 32 .. kSoftmaxThreads threads; blocks are kSoftmaxThreads threads.
  const int target_elems = kBackward ? 1 : 32;
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
  const int block = (kSoftmaxThreads / tpr) * tpr;
  const int64_t groups = (p.rows + block / tpr - 1) / (block / tpr);
  const int grid = GridStrideBlocks(groups * block, block, 2048 / block);
  const Status s = vec ? LaunchChunks<Tag, kVec, kBackward>(chunks, p, block, grid, stream)
                       : LaunchChunks<Tag, 1, kBackward>(chunks, p, block, grid, stream);
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
