// CPU reference of the block quantizers' dbias: the summation order of block_dbias.h, step
// for step (lane sums, tile sums, the finalize's interleaved sums), row-major walks.
#include <string>
#include <vector>

#include "common/element.h"
#include "common/ieee_denormals.h"
#include "quantize/block_dbias.h"

namespace lowbit {

Status BlockDbiasRef(const char* op, const void* x, DType x_dtype, int64_t rows, int64_t cols,
                     int64_t tile_rows, void* dbias, DType dbias_dtype) {
  const ScopedIeeeDenormals ieee;  // as the GPU (see ieee_denormals.h)
  LOWBIT_RETURN_IF_ERROR(CheckBlockDbiasDType(op, x_dtype, dbias_dtype));
  return DispatchHighPrecision(x_dtype, op, "x", [&](auto tag) {
    using T = typename decltype(tag)::Storage;
    const T* xs = static_cast<const T*>(x);
    const int64_t lanes = 32 / int64_t(sizeof(T));
    const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
    const size_t n = size_t(cols);
    std::vector<float> lane(n), tile(n);
    std::vector<float> interleaved(size_t(kDbiasFinalizeRows) * n, 0.0f);  // w[y][c]
    for (int64_t t = 0; t < tiles; ++t) {
      tile.assign(n, 0.0f);
      for (int64_t g = 0; g < lanes; ++g) {
        lane.assign(n, 0.0f);
        for (int64_t r = t * tile_rows + g; r < (t + 1) * tile_rows; r += lanes) {
          for (size_t c = 0; c < n; ++c) lane[c] += r < rows ? LoadAsFloat(tag, xs[r * cols + int64_t(c)]) : 0.0f;
        }
        for (size_t c = 0; c < n; ++c) tile[c] += lane[c];
      }
      float* w = interleaved.data() + size_t(t % kDbiasFinalizeRows) * n;
      for (size_t c = 0; c < n; ++c) w[c] += tile[c];
    }
    for (size_t c = 0; c < n; ++c) {
      float total = 0.0f;
      for (int y = 0; y < kDbiasFinalizeRows; ++y) total += interleaved[size_t(y) * n + c];
      total = DbiasCanonical(total);
      if (dbias_dtype == DType::kF32) {
        static_cast<float*>(dbias)[c] = total;
      } else {
        static_cast<T*>(dbias)[c] = StoreFromFloat(tag, total);
      }
    }
    return Status::Ok();
  });
}

}  // namespace lowbit
