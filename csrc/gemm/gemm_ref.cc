// CPU reference for lowbit_gemm (numerics in gemm.h): out = s * (a @ b^T) + bias with
// s = fl(a_scale_inv * b_scale_inv), each dot product summed in fp32 in increasing k order.
// Block scale modes are the exact emulation of gemm.h: every decoded row is multiplied by its
// block scales as it is decoded (fl(decode(q) * s)), and s = 1.
//
// Speed: b is decoded to fp32 one block of kBlockN columns at a time, transposed to
// (K, kBlockN) so that the innermost loop runs over contiguous n; a is decoded kTileM rows
// at a time. The micro-kernel keeps a kTileM x kTileN tile of accumulators in registers and
// walks k, so every output still sees its products added one at a time in k order (the
// loops only reorder independent outputs, never the terms of one sum). Rows of out are split
// over up to 4 threads for large problems; each output is computed by exactly one thread in
// the same order, so the result does not depend on the split.
#include <algorithm>
#include <array>
#include <cstring>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "common/element.h"
#include "common/ieee_denormals.h"
#include "common/formats.h"
#include "gemm/gemm.h"

namespace lowbit {
namespace {

constexpr int64_t kTileM = 4;     // rows of a per micro-kernel call
constexpr int64_t kTileN = 8;     // columns per micro-kernel call: 4x8 accumulators = 8 of the 16 SSE registers (measured best)
constexpr int64_t kBlockN = 256;  // decoded b block: K x 256 fp32 (1 MiB at K = 1024) stays in L2
constexpr int64_t kMaxThreads = 4;
constexpr int64_t kMinMacsPerThread = int64_t(1) << 22;  // below this a thread costs more than it saves

// Decodes `count` elements of `type` starting at element `offset` of `data` to fp32.
class Decoder {
 public:
  explicit Decoder(DType type) : type_(type) {
    if (type == DType::kE4M3 || type == DType::kE5M2) {
      for (int i = 0; i < 256; ++i) {
        lut_[i] = type == DType::kE4M3 ? E4m3ToFloat(uint8_t(i)) : E5m2ToFloat(uint8_t(i));
      }
    }
  }

  void Run(const void* data, int64_t offset, int64_t count, float* out) const {
    switch (type_) {
      case DType::kE4M3:
      case DType::kE5M2: {
        const uint8_t* p = static_cast<const uint8_t*>(data) + offset;
        for (int64_t i = 0; i < count; ++i) out[i] = lut_[p[i]];
        return;
      }
      case DType::kBF16: {
        const uint16_t* p = static_cast<const uint16_t*>(data) + offset;
        for (int64_t i = 0; i < count; ++i) out[i] = Bf16ToFloat(p[i]);
        return;
      }
      case DType::kF16: {
        const uint16_t* p = static_cast<const uint16_t*>(data) + offset;
        for (int64_t i = 0; i < count; ++i) out[i] = Fp16ToFloat(p[i]);
        return;
      }
      default:
        std::fill(out, out + count, 0.0f);  // unreachable: CheckGemmTypes ran first
    }
  }

 private:
  DType type_;
  std::array<float, 256> lut_{};
};

// One operand (a or b): its data decoded row by row to fp32, times its block scales when
// its scale mode is a block mode.
class Operand {
 public:
  Operand(const void* data, DType type, GemmScaleMode mode, const void* scale, int64_t rows,
          int64_t k)
      : data_(data), decoder_(type), mode_(mode), scale_(scale), k_(k),
        dims_(GemmScaleDims(mode, rows, k)) {}
  // kNvfp4: packed E2M1 data, e4m3 block scales and the global scale_inv.
  Operand(const void* data, const void* scale, float global_scale_inv, int64_t rows, int64_t k)
      : data_(data), decoder_(DType::kE2M1), mode_(GemmScaleMode::kNvfp4), scale_(scale), k_(k),
        dims_(GemmScaleDims(GemmScaleMode::kNvfp4, rows, k)), global_(global_scale_inv) {}

  void Row(int64_t r, float* out) const {
    if (mode_ == GemmScaleMode::kNvfp4) {
      const uint8_t* q = static_cast<const uint8_t*>(data_) + r * ((k_ + 1) / 2);
      const uint8_t* s = static_cast<const uint8_t*>(scale_) + r * dims_.dim1;
      for (int64_t kk = 0; kk < k_; ++kk) {
        const uint8_t nibble = kk % 2 ? uint8_t(q[kk / 2] >> 4) : uint8_t(q[kk / 2] & 0xF);
        out[kk] = (E2m1ToFloat(nibble) * E4m3ToFloat(s[kk / 16])) * global_;  // first product exact
      }
      return;
    }
    decoder_.Run(data_, r * k_, k_, out);
    switch (mode_) {
      case GemmScaleMode::kBlock1x128: {
        const float* s = static_cast<const float*>(scale_);
        for (int64_t kk = 0; kk < k_; ++kk) out[kk] = out[kk] * s[(kk / 128) * dims_.dim1 + r];
        return;
      }
      case GemmScaleMode::kBlock128x128: {
        const float* s = static_cast<const float*>(scale_) + (r / 128) * dims_.dim1;
        for (int64_t kk = 0; kk < k_; ++kk) out[kk] = out[kk] * s[kk / 128];
        return;
      }
      case GemmScaleMode::kMxfp8: {
        const uint8_t* s = static_cast<const uint8_t*>(scale_) + r * dims_.dim1;
        for (int64_t kk = 0; kk < k_; ++kk) out[kk] = out[kk] * E8m0ToFloat(s[kk / 32]);
        return;
      }
      default:
        return;
    }
  }

 private:
  const void* data_;
  Decoder decoder_;
  GemmScaleMode mode_;
  const void* scale_;
  int64_t k_;
  GemmScaleShape dims_;
  float global_ = 1.0f;
};

Operand MakeOperand(const GemmArgs& args, bool is_a) {
  const int64_t rows = is_a ? args.m : args.n;
  if (args.a_scale_mode == GemmScaleMode::kNvfp4) {
    return Operand(is_a ? args.a : args.b, is_a ? args.a_scale_inv : args.b_scale_inv,
                   (is_a ? args.a_global_scale_inv : args.b_global_scale_inv)[0], rows, args.k);
  }
  return Operand(is_a ? args.a : args.b, is_a ? args.a_type : args.b_type,
                 is_a ? args.a_scale_mode : args.b_scale_mode,
                 is_a ? args.a_scale_inv : args.b_scale_inv, rows, args.k);
}

// acc[i][j] = sum over k of a_tile[i][k] * b_t[k][j], k ascending. a_tile is kTileM rows of
// `k` floats; b_t has row stride `ldb` and kTileN valid columns.
inline void MicroKernel(const float* a_tile, int64_t k, const float* b_t, int64_t ldb,
                        float acc[kTileM][kTileN]) {
  float c[kTileM][kTileN] = {};  // local, so the compiler keeps it in registers
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* bk = b_t + kk * ldb;
    for (int64_t i = 0; i < kTileM; ++i) {
      const float av = a_tile[i * k + kk];
      for (int64_t j = 0; j < kTileN; ++j) c[i][j] += av * bk[j];
    }
  }
  for (int64_t i = 0; i < kTileM; ++i) {
    for (int64_t j = 0; j < kTileN; ++j) acc[i][j] = c[i][j];
  }
}

// Rows [row_begin, row_end) of out.
template <typename OutTag>
void GemmRows(const GemmArgs& args, float scale, int64_t row_begin, int64_t row_end) {
  using Out = typename OutTag::Storage;
  const int64_t k = args.k, n = args.n;
  const Operand op_a = MakeOperand(args, true);
  const Operand op_b = MakeOperand(args, false);
  const Out* bias = static_cast<const Out*>(args.bias);
  Out* out = static_cast<Out*>(args.out);

  std::vector<float> b_t(size_t(k) * kBlockN);   // (k, kBlockN), zero beyond the valid columns
  std::vector<float> a_tile(size_t(kTileM) * k);  // (kTileM, k), zero beyond the valid rows
  std::vector<float> b_row(static_cast<size_t>(k));
  float acc[kTileM][kTileN];

  for (int64_t n0 = 0; n0 < n; n0 += kBlockN) {
    const int64_t block_n = std::min(kBlockN, n - n0);
    const int64_t padded_n = (block_n + kTileN - 1) / kTileN * kTileN;
    std::fill(b_t.begin(), b_t.end(), 0.0f);
    for (int64_t j = 0; j < block_n; ++j) {
      op_b.Row(n0 + j, b_row.data());
      for (int64_t kk = 0; kk < k; ++kk) b_t[size_t(kk * kBlockN + j)] = b_row[size_t(kk)];
    }
    for (int64_t m0 = row_begin; m0 < row_end; m0 += kTileM) {
      const int64_t tile_m = std::min(kTileM, row_end - m0);
      for (int64_t i = 0; i < kTileM; ++i) {
        float* dst = a_tile.data() + i * k;
        if (i < tile_m) {
          op_a.Row(m0 + i, dst);
        } else {
          std::fill(dst, dst + k, 0.0f);
        }
      }
      for (int64_t j0 = 0; j0 < padded_n; j0 += kTileN) {
        MicroKernel(a_tile.data(), k, b_t.data() + j0, kBlockN, acc);
        const int64_t tile_n = std::min(kTileN, block_n - j0);
        for (int64_t i = 0; i < tile_m; ++i) {
          Out* row = out + (m0 + i) * n + n0 + j0;
          for (int64_t j = 0; j < tile_n; ++j) {
            float y = scale * acc[i][j];
            if (bias) y = y + LoadAsFloat(OutTag{}, bias[n0 + j0 + j]);
            if (args.accumulate) y = y + LoadAsFloat(OutTag{}, row[j]);
            row[j] = StoreFromFloat(OutTag{}, y);
          }
        }
      }
    }
  }
}

// Runs GemmRows and reports an allocation failure instead of throwing (it may run on a
// worker thread, where an escaping exception would terminate the process).
template <typename OutTag>
bool GemmRowsNoThrow(const GemmArgs& args, float scale, int64_t begin, int64_t end) {
  try {
    GemmRows<OutTag>(args, scale, begin, end);
  } catch (const std::bad_alloc&) {
    return false;
  }
  return true;
}

template <typename OutTag>
Status GemmAllRows(const GemmArgs& args, float scale) {
  const int64_t macs = args.m * args.n * std::max<int64_t>(args.k, 1);
  const int64_t cores = std::max<unsigned>(1, std::thread::hardware_concurrency());
  int64_t threads = std::min(kMaxThreads, cores);
  threads = std::min(threads, std::max<int64_t>(1, macs / kMinMacsPerThread));
  const int64_t tiles = (args.m + kTileM - 1) / kTileM;
  threads = std::min(threads, tiles);
  // Row ranges in whole tiles, as equal as possible; range 0 runs on this thread, and so
  // does any range whose thread cannot be started.
  std::vector<std::thread> pool;
  std::vector<char> ok(size_t(threads), 1);
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t begin = std::min(args.m, tiles * t / threads * kTileM);
    const int64_t end = std::min(args.m, tiles * (t + 1) / threads * kTileM);
    char* flag = &ok[size_t(t)];
    try {
      pool.emplace_back([&args, scale, begin, end, flag] {
        *flag = GemmRowsNoThrow<OutTag>(args, scale, begin, end);
      });
    } catch (const std::system_error&) {
      *flag = GemmRowsNoThrow<OutTag>(args, scale, begin, end);
    }
  }
  ok[0] = GemmRowsNoThrow<OutTag>(args, scale, 0, std::min(args.m, tiles / threads * kTileM));
  for (std::thread& th : pool) th.join();
  if (std::find(ok.begin(), ok.end(), 0) != ok.end()) {
    return Status::Internal("lowbit_gemm: CPU reference: out of memory for its fp32 tiles (K=" +
                            std::to_string(args.k) + ")");
  }
  return Status::Ok();
}

}  // namespace

Status GemmRef(const GemmArgs& args) {
  const ScopedIeeeDenormals ieee;  // as the GPU (see ieee_denormals.h)
  if (args.a_scale_mode == GemmScaleMode::kNvfp4) {
    LOWBIT_RETURN_IF_ERROR(CheckNvfp4Gemm(args));
  } else {
    LOWBIT_RETURN_IF_ERROR(CheckGemmTypes(args.a_type, args.b_type, args.out_type));
    LOWBIT_RETURN_IF_ERROR(CheckGemmScaleModes(args.a_scale_mode, args.b_scale_mode, args.a_type));
  }
  if (args.m < 0 || args.n < 0 || args.k < 0) {
    return Status::InvalidArgument("lowbit_gemm: negative dimension M=" + std::to_string(args.m) +
                                   " N=" + std::to_string(args.n) + " K=" + std::to_string(args.k));
  }
  if ((args.lda != 0 && args.lda != args.k) || (args.ldb != 0 && args.ldb != args.k) ||
      (args.ldd != 0 && args.ldd != args.n) || args.batch != 1) {
    return Status::InvalidArgument("lowbit_gemm: lda, ldb, ldd, batch: the reference takes one GEMM of dense operands");
  }
  LOWBIT_RETURN_IF_ERROR(CheckGemmAccumulate(args));
  if (args.m == 0 || args.n == 0) return Status::Ok();
  const float scale =
      IsBlockScaleMode(args.a_scale_mode)
          ? 1.0f
          : static_cast<const float*>(args.a_scale_inv)[0] * static_cast<const float*>(args.b_scale_inv)[0];
  return DispatchHighPrecision(args.out_type, "lowbit_gemm", "out", [&](auto tag) {
    return GemmAllRows<decltype(tag)>(args, scale);
  });
}

}  // namespace lowbit
