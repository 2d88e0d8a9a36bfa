// amax: the largest absolute value of each row of a high-precision tensor, as fp32.
//
// Data: x is rows x cols, row-major, f32/f16/bf16; out has `rows` fp32 values.
// Invariants: the result is one of |x|'s values, chosen by comparing fp32 bit patterns
// of |x| as unsigned integers, so NaN (any payload) beats inf and the CPU reference and
// the CUDA kernel agree bit for bit; an empty row gives 0.
#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "common/gpu_stream.h"
#include "common/status.h"

namespace lowbit {

// CPU reference (amax_ref.cc).
Status AmaxRef(const void* x, DType dtype, int64_t rows, int64_t cols, float* out);

// CUDA launcher (amax.cu): zeroes `out` and reduces on `stream`, no host sync.
Status AmaxCuda(const void* x, DType dtype, int64_t rows, int64_t cols, float* out,
                GpuStream stream);

}  // namespace lowbit
