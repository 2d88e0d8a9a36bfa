// Inline-PTX wrappers of the block GEMM kernel (block_gemm_sm90_kernel.cuh): shared-memory
// loads, mbarriers, TMA loads (multicast too), cluster rank and barrier, wgmma's shared-memory
// descriptor, fence, commit and wait, and the m64n192k32 Wgmma per FP8 type pair. sm_90a device
// code only; private to block_gemm_sm90.cu's translation unit (an anonymous namespace).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "gemm/block_gemm_sm90_config.cuh"

namespace lowbit {
namespace {

#if defined(LOWBIT_SM90A_DEVICE)
__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ float LdSharedAddr(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ float2 LdShared2Addr(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ void MbarWaitAddr(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}
__device__ __forceinline__ void MbarInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddr(bar)), "r"(count));
}
__device__ __forceinline__ void MbarExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SmemAddr(bar)),
               "r"(bytes) : "memory");
}
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
  MbarWaitAddr(SmemAddr(bar), parity);
}
__device__ __forceinline__ void TmaLoad2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                          int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, "
      "%4}], [%2];" ::"r"(SmemAddr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(SmemAddr(bar)),
      "r"(c0), "r"(c1) : "memory");
}
// The same copy, written into the shared memory of every CTA in cta_mask at the same offset,
// each CTA's mbarrier at `bar`'s offset receiving the completed bytes.
__device__ __forceinline__ void TmaLoad2dMulticast(void* dst, const CUtensorMap* map, uint64_t* bar,
                                                   int c0, int c1, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::"
      "cluster [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(SmemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(SmemAddr(bar)), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}
// Arrive on the mbarrier at shared address `bar` in cluster CTA `cta` (this CTA included).
__device__ __forceinline__ void MbarArriveCluster(uint32_t bar, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
      "r"(cta) : "memory");
}
__device__ __forceinline__ uint32_t ClusterRank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void ClusterSync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void TmaPrefetchDescriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// wgmma's shared-memory matrix descriptor of a K-major tile of 8-row groups, 128 bytes per
// row, 128B swizzle (what the TMA above writes): start address >> 4, leading byte offset
// (unused for this swizzle; 1), stride byte offset 1024 (one 8-row group) >> 4, swizzle
// mode 1 = 128B in bits 62-63. Moving 32 bytes along K adds 2 to the start address.
__device__ __forceinline__ uint64_t SmemDescAddr(uint32_t tile) {
  const uint64_t addr = tile;
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void WgmmaWaitAll() {
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}

// d (64 rows x kTileN columns over the warpgroup's 128 threads) = a (64 x 32) * b (kTileN x 32)^T
// (+ d when accumulate != 0). Thread t of the warpgroup holds d[4i + {0,1}] at row
// 16*(t/32) + (t%32)/4, columns 8i + 2*(t%4) + {0,1}, and d[4i + {2,3}] eight rows lower.
#define LOWBIT_DEFINE_WGMMA(ATAG, BTAG, TYPES)                                                   \
  __device__ __forceinline__ void Wgmma(float(&d)[kAcc], uint64_t desc_a, uint64_t desc_b,        \
                                        int accumulate, ATAG, BTAG) {                             \
    asm volatile(                                                                                \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"                                             \
        "wgmma.mma_async.sync.aligned.m64n192k32.f32." TYPES " {"                                 \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"                                                                                     \
        "}, %96, %97, p, 1, 1;\n}\n"                                                            \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])                                                                                     \
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                           \
  }
LOWBIT_DEFINE_WGMMA(E4m3Tag, E4m3Tag, "e4m3.e4m3")
LOWBIT_DEFINE_WGMMA(E4m3Tag, E5m2Tag, "e4m3.e5m2")
LOWBIT_DEFINE_WGMMA(E5m2Tag, E4m3Tag, "e5m2.e4m3")
#endif  // sm_90a device code

}  // namespace
}  // namespace lowbit
