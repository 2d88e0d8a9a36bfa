// The CUDA activation kernels of act type kQuickGelu (activation_kernels.cuh), a translation unit
// of their own so that the build compiles the act types in parallel.
#include "activation/activation_kernels.cuh"

LOWBIT_DEFINE_ACT_TYPE_LAUNCH(kQuickGelu)
