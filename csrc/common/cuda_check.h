// Status helpers for CUDA runtime calls and kernel launches (CUDA translation units only).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

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

// Grid size for a grid-stride loop: enough blocks to fill every SM `blocks_per_sm` times,
// never more than the work needs.
inline int GridStrideBlocks(int64_t work_items, int threads, int blocks_per_sm = 4) {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  int64_t needed = (work_items + threads - 1) / threads;
  int64_t cap = int64_t(sms) * blocks_per_sm;
  int64_t blocks = needed < cap ? needed : cap;
  return blocks < 1 ? 1 : int(blocks);
}

}  // namespace lowbit
