// Device steps around the cuBLASLt GEMM: the 16-bit GEMMs' device alpha/beta and the f32
// bias add (see gemm_epilogue.h).
#include <cuda_runtime.h>

#include "common/cuda_check.h"
#include "gemm/gemm_epilogue.h"

namespace lowbit {
namespace {

constexpr int kThreads = 256;

__global__ void AlphaBetaKernel(const float* a_scale_inv, const float* b_scale_inv,
                                float* alpha_beta) {
  alpha_beta[0] = __fmul_rn(a_scale_inv[0], b_scale_inv[0]);
  alpha_beta[1] = 0.0f;
}

__global__ void BiasAddF32Kernel(float* __restrict__ out, const float* __restrict__ bias,
                                 int64_t total, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    out[i] = __fadd_rn(out[i], __ldg(bias + i % n));
  }
}

}  // namespace

Status GemmAlphaBetaCuda(const float* a_scale_inv, const float* b_scale_inv, float* alpha_beta,
                         GpuStream stream) {
  AlphaBetaKernel<<<1, 1, 0, stream>>>(a_scale_inv, b_scale_inv, alpha_beta);
  return LaunchStatus("lowbit_gemm");
}

Status GemmBiasAddF32Cuda(float* out, const float* bias, int64_t m, int64_t n, GpuStream stream) {
  const int64_t total = m * n;
  if (total == 0) return Status::Ok();
  BiasAddF32Kernel<<<GridStrideBlocks(total, kThreads), kThreads, 0, stream>>>(out, bias, total, n);
  return LaunchStatus("lowbit_gemm");
}

}  // namespace lowbit
