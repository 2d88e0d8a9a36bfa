// The CUDA activation launchers, one per act type (activation_kernels.cuh's kernels for every
// dtype, direction and gating), each defined in its own activation_<type>.cu so that the
// build compiles the types in parallel. activation.cu checks the arguments and dispatches.
#pragma once

#include "activation/activation.h"
#include "common/gpu_stream.h"
#include "common/status.h"

namespace lowbit::act_cuda {

// Launches a's forward (backward = false) or backward kernels for act type kType on stream;
// op names the op in errors. a is checked and non-empty.
template <ActType kType>
Status LaunchActType(const ActArgs& a, void* workspace, GpuStream stream, bool backward, const char* op);

#define LOWBIT_DECLARE_ACT_TYPE_LAUNCH(TYPE)                                                             \
  template <>                                                                                            \
  Status LaunchActType<ActType::TYPE>(const ActArgs& a, void* workspace, GpuStream stream, bool backward, \
                                      const char* op);
LOWBIT_DECLARE_ACT_TYPE_LAUNCH(kLinear)
LOWBIT_DECLARE_ACT_TYPE_LAUNCH(kGelu)
LOWBIT_DECLARE_ACT_TYPE_LAUNCH(kSilu)
LOWBIT_DECLARE_ACT_TYPE_LAUNCH(kRelu)
LOWBIT_DECLARE_ACT_TYPE_LAUNCH(kQuickGelu)
LOWBIT_DECLARE_ACT_TYPE_LAUNCH(kSquaredRelu)
LOWBIT_DECLARE_ACT_TYPE_LAUNCH(kClampedSilu)
#undef LOWBIT_DECLARE_ACT_TYPE_LAUNCH

}  // namespace lowbit::act_cuda
