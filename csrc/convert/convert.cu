// CUDA codec ops: the same per-element functions as the reference, one thread each.
#include <cuda_runtime.h>

#include <string>

#include "common/cuda_check.h"
#include "convert/convert_codec.h"

namespace lowbit {
namespace {

__global__ void EncodeKernel(const float* x, const uint32_t* random, CodecFormat format,
                             int64_t n, uint16_t* codes) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    codes[i] = EncodeOne(x[i], random, i, format);
  }
}

__global__ void DecodeKernel(const uint16_t* codes, CodecFormat format, int64_t n, float* x) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = DecodeOne(codes[i], format);
  }
}

}  // namespace

Status EncodeCuda(const float* x, const uint32_t* random, CodecFormat format, int64_t n,
                  uint16_t* codes, GpuStream stream) {
  LOWBIT_RETURN_IF_ERROR(CheckCodec(format, random != nullptr));
  if (n == 0) return Status::Ok();
  EncodeKernel<<<GridStrideBlocks(n, 256), 256, 0, stream>>>(x, random, format, n, codes);
  return LaunchStatus("lowbit_encode");
}

Status DecodeCuda(const uint16_t* codes, CodecFormat format, int64_t n, float* x,
                  GpuStream stream) {
  LOWBIT_RETURN_IF_ERROR(CheckCodec(format, false));
  if (n == 0) return Status::Ok();
  DecodeKernel<<<GridStrideBlocks(n, 256), 256, 0, stream>>>(codes, format, n, x);
  return LaunchStatus("lowbit_decode");
}

}  // namespace lowbit
