// CUDA fused activation + block quantization (fused_block.h): block_tiles.cuh's FP8 block
// (1x128) and MXFP8 tile kernels with a source that computes the activation in its chunk
// load, before the tile's amaxes and encodes, so x is read once and only the codes and
// scales are written. ActSource: a chunk of the activation input (and, gated, the same chunk
// of the gate half) -> activation_math.h's ActForwardValue (the reference's function).
// Template constants: dtype, code format, gated, vector / scalar path; the act type is a
// uniform runtime value (ActValueAndDerivative selects on it branch-free). The norm twin is
// fused_block_norm.cu, the gated kernels fused_block_act_gated.cu (apart, so that the build
// compiles them in parallel; kernels and launch: fused_block_act.cuh).
#include <string>

#include "fused_block/fused_block_act.cuh"

namespace lowbit {

namespace fused_act_cuda {
template <>
Status LaunchActTiles<false>(const ActQuantizeBlockArgs& a, GpuStream stream) {
  return LaunchActTilesImpl<false>(a, stream);
}
}  // namespace fused_act_cuda

Status ActQuantizeBlockCuda(const ActQuantizeBlockArgs& a, GpuStream stream) {
  if (!a.mxfp8 && a.fp8.tile_2d) return Status::InvalidArgument(std::string(kOp) + ": tile_2d: only 1x128 tiles");
  return a.params.gated ? fused_act_cuda::LaunchActTiles<true>(a, stream)
                        : fused_act_cuda::LaunchActTiles<false>(a, stream);
}

}  // namespace lowbit
