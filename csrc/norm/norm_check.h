// Argument checks shared by the CPU reference and the CUDA launchers (see norm.h): the
// dtypes, the supported hidden range and the pointers a norm type and its outputs need.
// Errors name the FFI target and the argument, e.g.
// "lowbit_norm_forward: x: hidden size 20000 exceeds the supported maximum 16384".
#pragma once

#include <string>

#include "common/dtype.h"
#include "common/status.h"
#include "norm/norm.h"

namespace lowbit {

inline Status CheckNormCommon(const char* op, NormType type, int64_t rows, int64_t hidden,
                              DType x_dtype, DType gamma_dtype) {
  const std::string p = std::string(op) + ": ";
  if (type != NormType::kLayerNorm && type != NormType::kRmsNorm) {
    return Status::InvalidArgument(p + "norm_type: expected 0 (layernorm) or 1 (rmsnorm), got " +
                                   std::to_string(int(type)));
  }
  if (!IsHighPrecision(x_dtype)) {
    return Status::InvalidArgument(p + "x: expected f32, f16 or bf16, got " + DTypeName(x_dtype));
  }
  if (gamma_dtype != DType::kF32 && gamma_dtype != x_dtype) {
    return Status::InvalidArgument(p + "gamma: expected f32 or x's dtype " + DTypeName(x_dtype) +
                                   ", got " + DTypeName(gamma_dtype));
  }
  if (rows < 0) return Status::InvalidArgument(p + "x: negative row count");
  if (hidden < 1) return Status::InvalidArgument(p + "x: hidden size must be at least 1");
  if (hidden > kNormMaxHidden) {
    return Status::InvalidArgument(p + "x: hidden size " + std::to_string(hidden) +
                                   " exceeds the supported maximum " +
                                   std::to_string(kNormMaxHidden));
  }
  return Status::Ok();
}

inline Status CheckNormForward(const NormForwardArgs& a, const char* op) {
  LOWBIT_RETURN_IF_ERROR(
      CheckNormCommon(op, a.norm_type, a.rows, a.hidden, a.x_dtype, a.gamma_dtype));
  const std::string p = std::string(op) + ": ";
  const bool ln = a.norm_type == NormType::kLayerNorm;
  if (!(a.epsilon >= 0.0f) || a.epsilon > 3.0e38f) {
    return Status::InvalidArgument(p + "epsilon: expected a finite value >= 0");
  }
  if (a.rows == 0) return Status::Ok();
  if (a.x == nullptr || a.gamma == nullptr || a.rsigma == nullptr) {
    return Status::InvalidArgument(p + "x, gamma and rsigma are required");
  }
  if (ln && (a.beta == nullptr || a.mu == nullptr)) {
    return Status::InvalidArgument(p + "beta, mu: required for layernorm");
  }
  if (!ln && (a.beta != nullptr || a.mu != nullptr)) {
    return Status::InvalidArgument(p + "beta, mu: expected empty for rmsnorm");
  }
  if (a.q_rowwise != nullptr || a.q_colwise != nullptr) {
    if (!IsFp8(a.q_dtype)) {
      return Status::InvalidArgument(p + "y_q: expected f8e4m3fn or f8e5m2, got " +
                                     DTypeName(a.q_dtype));
    }
    if (a.scale == nullptr) {
      return Status::InvalidArgument(p + "scale: expected shape (1,) with a quantized output");
    }
  }
  return Status::Ok();
}

inline Status CheckNormBackward(const NormBackwardArgs& a, const char* op) {
  LOWBIT_RETURN_IF_ERROR(
      CheckNormCommon(op, a.norm_type, a.rows, a.hidden, a.x_dtype, a.gamma_dtype));
  const std::string p = std::string(op) + ": ";
  const bool ln = a.norm_type == NormType::kLayerNorm;
  if (a.gamma == nullptr || a.dgamma == nullptr) {
    return Status::InvalidArgument(p + "gamma and dgamma are required");
  }
  if (ln != (a.dbeta != nullptr)) {
    return Status::InvalidArgument(p + "dbeta: required for layernorm, empty for rmsnorm");
  }
  if (a.rows == 0) return Status::Ok();
  if (a.dz == nullptr || a.x == nullptr || a.rsigma == nullptr || a.dx == nullptr) {
    return Status::InvalidArgument(p + "dz, x, rsigma and dx are required");
  }
  if (ln != (a.mu != nullptr)) {
    return Status::InvalidArgument(p + "mu: required for layernorm, empty for rmsnorm");
  }
  return Status::Ok();
}

}  // namespace lowbit
