// CUDA scale ops (scale.h): the shared LOWBIT_HD formulas (divisions are __fdiv_rn),
// so the bits equal the CPU reference. The data is a few floats: ComputeScale and
// ScaleInverse use one thread per value, the delayed update one thread in all.
#include <cuda_runtime.h>

#include "common/cuda_check.h"
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

__global__ void UpdateDelayedKernel(const float* __restrict__ history, int64_t len,
                                    const float* __restrict__ scale,
                                    const float* __restrict__ new_amax, float fp8_max,
                                    int32_t margin, bool most_recent,
                                    float* __restrict__ new_history, float* __restrict__ new_scale,
                                    float* __restrict__ scale_inv) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  DelayedUpdateOne(history, len, *scale, *new_amax, fp8_max, margin, most_recent, new_history,
                   new_scale, scale_inv);
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
  UpdateDelayedKernel<<<1, 1, 0, stream>>>(history, len, scale, new_amax, fp8_max, margin,
                                           most_recent, new_history, new_scale, scale_inv);
  return LaunchStatus("lowbit_update_delayed_scaling");
}

}  // namespace lowbit
