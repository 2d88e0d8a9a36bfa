// Status helpers for CUDA runtime calls and kernel launches (CUDA translation units only).
#pragma once

#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "common/status.h"

namespace lowbit {

inline Status CudaStatus(cudaError_t err, const char* op, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  // A failed runtime call also leaves its error as the thread's last error, which the next
  // op's LaunchStatus would report as its own launch failing: this status reports it, so
  // clear it (a sticky error, a broken context, stays and is reported again, as it must).
  (void)cudaGetLastError();
  return Status::Internal(std::string(op) + ": " + what + " failed: " + cudaGetErrorName(err) +
                          " (" + cudaGetErrorString(err) + ")");
}

// Call right after a <<<...>>> launch: reports bad configurations and sticky errors.
inline Status LaunchStatus(const char* op) {
  return CudaStatus(cudaGetLastError(), op, "kernel launch");
}

// Raises `kernel`'s dynamic shared-memory limit on the current device to at least `bytes` and
// never lowers it. The attribute belongs to the kernel (per device), not to the launch, so every
// host thread shares it: a thread that set a smaller value for its own shape between another
// thread's set and launch would make that launch fail. Raise-only under one lock, the limit
// is always at least what any launch in flight asked for (occupancy follows each launch's own
// shared memory, not the limit).
template <typename Kernel>
Status RaiseDynamicSmemLimit(Kernel kernel, int bytes, const char* op) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> limits;  // (kernel, device) -> limit set
  int device = 0;
  Status status = CudaStatus(cudaGetDevice(&device), op, "cudaGetDevice");
  if (!status.ok()) return status;
  std::lock_guard<std::mutex> lock(mutex);
  int& limit = limits[{reinterpret_cast<const void*>(kernel), device}];
  if (bytes <= limit) return Status::Ok();
  status = CudaStatus(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), op,
                      "cudaFuncSetAttribute");
  if (status.ok()) limit = bytes;
  return status;
}

// The current device's SM count; 132 where the runtime cannot tell (its error is cleared, so
// that the next launch's check does not report it as its own).
inline int DeviceSmCount() {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    (void)cudaGetLastError();
    sms = 132;
  }
  return sms;
}

// Grid size for a grid-stride loop: enough blocks to fill every SM `blocks_per_sm` times,
// never more than the work needs.
inline int GridStrideBlocks(int64_t work_items, int threads, int blocks_per_sm = 4) {
  const int sms = DeviceSmCount();
  int64_t needed = (work_items + threads - 1) / threads;
  int64_t cap = int64_t(sms) * blocks_per_sm;
  int64_t blocks = needed < cap ? needed : cap;
  return blocks < 1 ? 1 : int(blocks);
}

}  // namespace lowbit
