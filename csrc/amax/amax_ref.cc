// CPU reference for amax (see amax.h for the data layout and the NaN rule).
#include "amax/amax.h"
#include "common/element.h"

namespace lowbit {

Status AmaxRef(const void* x, DType dtype, int64_t rows, int64_t cols, float* out) {
  return DispatchHighPrecision(dtype, "lowbit_amax", "x", [&](auto tag) {
    using T = typename decltype(tag)::Storage;
    const T* data = static_cast<const T*>(x);
    for (int64_t r = 0; r < rows; ++r) {
      uint32_t best = 0;
      for (int64_t c = 0; c < cols; ++c) {
        uint32_t bits = FloatBits(LoadAsFloat(tag, data[r * cols + c])) & 0x7FFFFFFFu;
        best = bits > best ? bits : best;
      }
      out[r] = BitsToFloat(best);
    }
    return Status::Ok();
  });
}

}  // namespace lowbit
