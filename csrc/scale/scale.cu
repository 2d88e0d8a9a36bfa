// CUDA scale ops (scale.h): the shared LOWBIT_HD formulas (divisions are __fdiv_rn),
// so the bits equal the CPU reference. ComputeScale and ScaleInverse use one thread per
// value. The delayed update is one block: its threads roll the history and reduce its max
// as order keys (OrderKey: a max is order independent, so the result equals the serial
// reference's bit for bit) with a block-wide NaN flag; thread 0 then makes the scale. A
// single thread walking a 1024-entry history took ~110 us on an H100.
#include <cuda_runtime.h>

#include "common/cuda_check.h"
#include "common/reduce.cuh"
#include "scale/scale.h"

namespace lowbit {
namespace {

constexpr int kThreads = 128;

__global__ void ComputeScaleKernel(const float* __restrict__ amax, int64_t n, float fp8_max,
                                   bool pow2, float* __restrict__ scale,
                                   float* __restrict__ scale_inv) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float s = CurrentScale(amax[i], fp8_max, pow2);
    scale[i] = s;
    scale_inv[i] = ScaleDivRn(1.0f, s);
  }
}

__global__ void ScaleInverseKernel(const float* __restrict__ scale, int64_t n,
                                   float* __restrict__ scale_inv) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    scale_inv[i] = ScaleDivRn(1.0f, scale[i]);
  }
}

constexpr int kUpdateThreads = 256;

// Inverse of OrderKey for a key of a non-NaN float.
__device__ __forceinline__ float FromOrderKey(uint32_t key) {
  return BitsToFloat((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

__global__ void __launch_bounds__(kUpdateThreads)
    UpdateDelayedKernel(const float* __restrict__ history, int64_t len,
                        const float* __restrict__ scale, const float* __restrict__ new_amax_ptr,
                        float fp8_max, int32_t margin, bool most_recent,
                        float* __restrict__ new_history, float* __restrict__ new_scale,
                        float* __restrict__ scale_inv) {
  const float new_amax = *new_amax_ptr;
  uint32_t key = 0;  // below the key of every non-NaN float
  bool nan = false;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    // roll(h', -1) with h'[0] = new_amax, then element 0 = 0 (as DelayedUpdateOne).
    const float h = i + 1 < len ? history[i + 1] : new_amax;
    new_history[i] = i == 0 ? 0.0f : h;
    if (!most_recent && i + 1 < len) {
      if (IsNanBits(FloatBits(h))) {
        nan = true;
      } else {
        const uint32_t k = OrderKey(h);
        key = k > key ? k : key;
      }
    }
  }
  nan = __syncthreads_or(nan);
  key = BlockMaxU32(key);
  if (threadIdx.x != 0) return;
  float a = new_amax;
  if (!most_recent && !IsNanBits(FloatBits(new_amax))) {
    if (nan) {
      a = BitsToFloat(0x7FC00000u);
    } else if (key > OrderKey(new_amax)) {
      a = FromOrderKey(key);
    }
  }
  const float s = DelayedScale(a, *scale, fp8_max, margin);
  *new_scale = s;
  *scale_inv = ScaleDivRn(1.0f, s);
}

int Blocks(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return int(b < 1024 ? b : 1024);
}

}  // namespace

Status ComputeScaleCuda(const float* amax, int64_t n, float fp8_max, bool use_power_2_scales,
                        float* scale, float* scale_inv, GpuStream stream) {
  if (n == 0) return Status::Ok();
  ComputeScaleKernel<<<Blocks(n), kThreads, 0, stream>>>(amax, n, fp8_max, use_power_2_scales,
                                                         scale, scale_inv);
  return LaunchStatus("lowbit_compute_scale");
}

Status ScaleInverseCuda(const float* scale, int64_t n, float* scale_inv, GpuStream stream) {
  if (n == 0) return Status::Ok();
  ScaleInverseKernel<<<Blocks(n), kThreads, 0, stream>>>(scale, n, scale_inv);
  return LaunchStatus("lowbit_scale_inverse");
}

Status UpdateDelayedScalingCuda(const float* history, int64_t len, const float* scale,
                                const float* new_amax, float fp8_max, int32_t margin,
                                bool most_recent, float* new_history, float* new_scale,
                                float* scale_inv, GpuStream stream) {
  if (len < 1) {
    return Status::InvalidArgument("lowbit_update_delayed_scaling: amax_history: expected length >= 1");
  }
  UpdateDelayedKernel<<<1, kUpdateThreads, 0, stream>>>(history, len, scale, new_amax, fp8_max,
                                                         margin, most_recent, new_history,
                                                         new_scale, scale_inv);
  return LaunchStatus("lowbit_update_delayed_scaling");
}

}  // namespace lowbit
