// ScopedIeeeDenormals: host code that must agree bit for bit with the CUDA kernels runs
// under this guard. nvcc's default (-ftz=false) keeps subnormal inputs, results and
// intermediates, but XLA's CPU runtime sets FTZ/DAZ (tsl's ScopedFlushDenormal) around the
// computations that call FFI handlers, which would flush them on the CPU. MXCSR/FPCR are
// per thread: worker threads a reference starts need their own guard.
#pragma once

#include <cstdint>

#if !defined(__CUDACC__)
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace lowbit {

class ScopedIeeeDenormals {
 public:
#if defined(__x86_64__) || defined(__i386__)
  ScopedIeeeDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~0x8040u); }  // FTZ, DAZ
  ~ScopedIeeeDenormals() { _mm_setcsr(saved_); }
#elif defined(__aarch64__)
  ScopedIeeeDenormals() {
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved_));
    const uint64_t off = saved_ & ~(uint64_t(1) << 24);  // FZ
    __asm__ __volatile__("msr fpcr, %0" : : "r"(off));
  }
  ~ScopedIeeeDenormals() { __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_)); }
#endif
  ScopedIeeeDenormals(const ScopedIeeeDenormals&) = delete;
  ScopedIeeeDenormals& operator=(const ScopedIeeeDenormals&) = delete;

 private:
#if defined(__aarch64__)
  uint64_t saved_ = 0;
#else
  unsigned saved_ = 0;
#endif
};

}  // namespace lowbit
#endif  // !__CUDACC__
