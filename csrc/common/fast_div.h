// Unsigned 32-bit division by a divisor that is fixed for a whole kernel launch, as one
// multiply-high, a subtract, an add and two shifts instead of the ~25 instructions of a
// general integer division on NVIDIA GPUs (which have no divide unit). The method is
// Granlund and Montgomery's ("Division by invariant integers using multiplication", 1994,
// figure 4.1): with l = ceil(log2 d) and m = floor(2^32 (2^l - d) / d) + 1,
//   t = mulhi(n, m),  n / d = (t + ((n - t) >> min(l, 1))) >> max(l - 1, 0)
// for every 32-bit n. Built on the host (or once per thread), used in device loops; the
// host side of Div exists for the GoogleTest (fast_div_test.cc).
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace lowbit {

struct FastDivU32 {
  uint32_t d = 1, mul = 1, sh1 = 0, sh2 = 0;

  FastDivU32() = default;
  // divisor 0 is taken as 1 (callers divide only where the divisor is positive).
  LOWBIT_HD explicit FastDivU32(uint32_t divisor) : d(divisor == 0 ? 1 : divisor) {
    uint32_t l = 0;
    while ((uint64_t(1) << l) < d) ++l;
    mul = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << l) - d)) / d + 1);
    sh1 = l > 0 ? 1 : 0;
    sh2 = l > 0 ? l - 1 : 0;
  }

  LOWBIT_HD uint32_t Div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t t = __umulhi(n, mul);
#else
    const uint32_t t = uint32_t((uint64_t(n) * mul) >> 32);
#endif
    return (t + ((n - t) >> sh1)) >> sh2;
  }
};

}  // namespace lowbit
