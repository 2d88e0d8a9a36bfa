// The gated fused activation + block quantization kernels (fused_block_act.cuh), a
// translation unit of their own so that the build compiles them beside the plain ones.
#include "fused_block/fused_block_act.cuh"

namespace lowbit::fused_act_cuda {

template <>
Status LaunchActTiles<true>(const ActQuantizeBlockArgs& a, GpuStream stream) {
  return LaunchActTilesImpl<true>(a, stream);
}

}  // namespace lowbit::fused_act_cuda
