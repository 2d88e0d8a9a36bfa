// LowbitCudaArchProbe: whether the CUDA library holds device code that runs on a GPU.
// lowbit/_ffi.py calls it once per compute capability among JAX's GPUs before it registers
// the CUDA handlers, so that a GPU the build has no code for (the default build makes sm_90a
// and sm_100a machine code only, which runs on compute capability 9.0 and 10.0 exactly) gets
// one clear error when an op is lowered, instead of "no kernel image" when a kernel launches.
// The probe asks the runtime for the attributes of an empty kernel compiled with the same
// -gencode flags as every other kernel of the library.
#include <cuda_runtime.h>

namespace lowbit {
namespace {

__global__ void ArchProbeKernel() {}

}  // namespace
}  // namespace lowbit

extern "C" {

// 0: the library has device code for CUDA device `ordinal`; 1: it has none (no compatible
// machine code or PTX); -1 - e for any other CUDA error e (no such device, no driver). The
// calling thread's current device is left as it was.
__attribute__((visibility("default"))) int LowbitCudaArchProbe(int ordinal) {
  // An ordinal past the devices is answered without asking the runtime to switch to it (no
  // failing API call, which compute-sanitizer would report).
  int count = 0, previous = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaSuccess && (ordinal < 0 || ordinal >= count)) err = cudaErrorInvalidDevice;
  if (err == cudaSuccess) err = cudaGetDevice(&previous);
  if (err == cudaSuccess) err = cudaSetDevice(ordinal);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return -1 - int(err);
  }
  cudaFuncAttributes attributes;
  err = cudaFuncGetAttributes(&attributes, lowbit::ArchProbeKernel);
  cudaGetLastError();  // neither outcome leaves a sticky error behind
  cudaSetDevice(previous);
  if (err == cudaSuccess) return 0;
  if (err == cudaErrorInvalidDeviceFunction || err == cudaErrorNoKernelImageForDevice) return 1;
  return -1 - int(err);
}

}  // extern "C"
