// CUDA activation forward and backward (activation.h): the argument checks and the dispatch
// to the act type's launcher (activation_launch.h; kernels: activation_kernels.cuh).
#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "activation/activation.h"
#include "activation/activation_launch.h"
#include "common/cuda_check.h"
#include "common/element.h"
#include "quantize/fp8_codec.h"

namespace lowbit {
namespace {

// Calls f(std::integral_constant<ActType, type>{}): one launcher per activation type.
template <typename F>
Status DispatchActType(ActType type, const char* op, F&& f) {
  switch (type) {
    case ActType::kLinear: return f(std::integral_constant<ActType, ActType::kLinear>{});
    case ActType::kGelu: return f(std::integral_constant<ActType, ActType::kGelu>{});
    case ActType::kSilu: return f(std::integral_constant<ActType, ActType::kSilu>{});
    case ActType::kRelu: return f(std::integral_constant<ActType, ActType::kRelu>{});
    case ActType::kQuickGelu: return f(std::integral_constant<ActType, ActType::kQuickGelu>{});
    case ActType::kSquaredRelu: return f(std::integral_constant<ActType, ActType::kSquaredRelu>{});
    case ActType::kClampedSilu: return f(std::integral_constant<ActType, ActType::kClampedSilu>{});
  }
  return Status::InvalidArgument(std::string(op) + ": act_type: expected a value in [0, 6], got " +
                                 std::to_string(int32_t(type)));
}

Status Run(const ActArgs& a, void* workspace, GpuStream stream, bool backward) {
  const char* op = backward ? "lowbit_act_backward" : "lowbit_act_forward";
  if (a.amax == nullptr) return Status::InvalidArgument(std::string(op) + ": amax: missing");
  const bool quantize = a.q_rowwise != nullptr || a.q_colwise != nullptr;
  if (quantize && a.scale == nullptr) return Status::InvalidArgument(std::string(op) + ": scale: missing");
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(a.amax, 0, sizeof(float), stream), op, "cudaMemsetAsync"));
  return DispatchHighPrecision(a.dtype, op, "x", [&](auto tag) {
    using Tag = decltype(tag);
    if (a.rows == 0 || a.hidden == 0) {
      if (!backward || a.dbias == nullptr || a.hidden == 0) return Status::Ok();
      const size_t bytes = size_t(ActOutCols(a, true)) * sizeof(typename Tag::Storage);
      return CudaStatus(cudaMemsetAsync(a.dbias, 0, bytes, stream), op, "cudaMemsetAsync");
    }
    return DispatchFp8(quantize ? a.q_dtype : DType::kE4M3, op, "q", [&](auto) {
      return DispatchActType(a.params.type, op, [&](auto type) {
        return act_cuda::LaunchActType<decltype(type)::value>(a, workspace, stream, backward, op);
      });
    });
  });
}

}  // namespace

Status ActForwardCuda(const ActArgs& a, GpuStream stream) { return Run(a, nullptr, stream, false); }

Status ActBackwardCuda(const ActArgs& a, void* workspace, GpuStream stream) {
  return Run(a, workspace, stream, true);
}

}  // namespace lowbit
