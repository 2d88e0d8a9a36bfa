// Small device steps around the cuBLASLt GEMM (gemm_epilogue.cu), used only by
// cublaslt_gemm_cuda.cc; see gemm.h for the numerics they implement.
#pragma once

#include <cstdint>

#include "common/gpu_stream.h"
#include "common/status.h"

namespace lowbit {

// alpha_beta[0] = fl(a_scale_inv[0] * b_scale_inv[0]), alpha_beta[1] = 0: the device-side
// alpha and beta of the 16-bit GEMMs (cuBLASLt's A/B scale pointers are FP8-only).
Status GemmAlphaBetaCuda(const float* a_scale_inv, const float* b_scale_inv, float* alpha_beta,
                         GpuStream stream);

// out[i, j] = fl(out[i, j] + bias[j]) over an (m, n) row-major f32 matrix: the bias of the
// f32-output GEMMs, whose cuBLASLt bias epilogue takes a bias type other than f32 for FP8.
// lowbit.ops.gemm itself never passes an f32 bias to the custom call: it adds it in XLA,
// where the add fuses into the output's consumer (a separate pass here cost 0.86 ms of a
// 23 ms transformer-layer step); this serves direct callers of the FFI target.
Status GemmBiasAddF32Cuda(float* out, const float* bias, int64_t m, int64_t n, GpuStream stream);

}  // namespace lowbit
