// cp.async (sm_80+, PTX ISA 7.0; the PTX ISA guide's "cp.async" section:
// https://docs.nvidia.com/cuda/parallel-thread-execution/#data-movement-and-conversion-instructions-cp-async):
// 16-byte global -> shared copies that hold no registers while in flight; .cg caches them in
// L2 only. Used by the kernels that stage their input tiles through shared memory
// (quantize/quantize_tiled.cuh, quantize/block_tiles.cuh). Below sm_80 the copy is a plain
// load and store, the commit and wait are no-ops.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define LOWBIT_HAS_CP_ASYNC 1
#else
#define LOWBIT_HAS_CP_ASYNC 0
#endif

namespace lowbit {

__device__ __forceinline__ void CopyAsync16(void* smem, const void* gmem) {
#if LOWBIT_HAS_CP_ASYNC
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(__cvta_generic_to_global(gmem))
               : "memory");
#else
  *static_cast<uint4*>(smem) = __ldg(static_cast<const uint4*>(gmem));
#endif
}

// Commits this thread's copies issued since the last commit as one group (possibly empty).
__device__ __forceinline__ void CopyAsyncCommit() {
#if LOWBIT_HAS_CP_ASYNC
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most kPending of this thread's groups are in flight. The thread then sees
// its own completed copies; __syncthreads() publishes them to the block.
template <int kPending>
__device__ __forceinline__ void CopyAsyncWait() {
#if LOWBIT_HAS_CP_ASYNC
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

}  // namespace lowbit
