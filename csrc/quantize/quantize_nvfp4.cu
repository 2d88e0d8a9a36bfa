// CUDA NVFP4 quantize (numerics and layouts: quantize_nvfp4.h), three launches on one stream:
//  1. global amaxes (|x| bit patterns, atomicMax) into the global_scale_inv results, used as
//     scratch: without RHT both copies hold the same values, so one AmaxCuda (amax/amax.h)
//     over x as a single row serves both; with RHT the colwise amax is that of the
//     transformed values, so Nvfp4AmaxKernel walks 16-row groups down each column and takes
//     the plain and the transformed amax in the same pass.
//  2. Nvfp4TileKernel: one 64 x 64 tile of x (and of the random words) per CTA, staged as
//     fp32 in shared memory with 16-byte loads; 256 threads, each quantizing one 16-value
//     block of the rowwise copy (a row segment) and one of the colwise copy (a column
//     segment, RHT'd in registers), writing its 8 packed bytes and its scale byte; tile_2d
//     amaxes are combined over 16 threads through shared memory. The scale arrays are zeroed
//     first (their padding must be 0); the data is written in full.
//  3. Nvfp4FinalizeKernel: global_scale_inv = 1 / S over the stored amaxes.
// Every rounding step is the header's LOWBIT_HD code (correctly rounded division, no FMA
// contraction), so the bits equal the CPU reference's; RNE encodes go through
// Nvfp4EncodeRneNonNanFactor, the cheaper exact twin of Nvfp4Encode for blocks without NaN.
#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "amax/amax.h"
#include "common/cuda_check.h"
#include "common/element.h"
#include "common/reduce.cuh"
#include "quantize/quantize_nvfp4.h"

namespace lowbit {
namespace {

constexpr const char* kOp = "lowbit_quantize_nvfp4";
constexpr int kTile = 64;                 // tile edge (a multiple of 16)
constexpr int kPitch = kTile + 1;         // shared-memory row pitch (2-way bank conflicts at most)
constexpr int kThreads = 256;             // = kTile * kTile / 16: one block per thread and copy
constexpr int kBlocksPerRow = kTile / 16;  // 16-value blocks across a tile row

struct CopyOut {
  uint8_t* data = nullptr;        // R x packed bytes, null when the copy is not requested
  uint8_t* scale = nullptr;       // ScaleDims row-major
  int64_t scale_pitch = 0;        // Nvfp4ScaleDims(R, C).dim1
  int64_t packed = 0;             // ceil(C / 2)
  const uint32_t* amax = nullptr;  // the copy's global amax bits (from pass 1)
};

// ------------------------------------------------------------------ pass 1 (RHT only)

// grid.x strides over columns, grid.y over 16-row groups. plain_out (may be null) gets
// max |x|; rht_out max |T v| over full groups and |x| over the partial last group.
template <typename Tag>
__global__ void Nvfp4AmaxKernel(const typename Tag::Storage* __restrict__ x, int64_t rows,
                                int64_t cols, const uint32_t* sign_word, uint32_t* plain_out,
                                uint32_t* rht_out) {
  const uint32_t sign_bits = *sign_word & 0xFFFFu;
  const int64_t groups = (rows + 15) / 16;
  uint32_t plain = 0, transformed = 0;
  for (int64_t g = blockIdx.y; g < groups; g += gridDim.y) {
    const int64_t r0 = g * 16;
    const bool full = r0 + 16 <= rows;
    for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < cols;
         c += int64_t(gridDim.x) * blockDim.x) {
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        v[i] = (full || r0 + i < rows) ? LoadAsFloat(Tag{}, x[(r0 + i) * cols + c]) : 0.0f;
        plain = max(plain, FloatBits(v[i]) & 0x7FFFFFFFu);
      }
      if (full) Nvfp4Rht16(v, sign_bits);
#pragma unroll
      for (int i = 0; i < 16; ++i) transformed = max(transformed, FloatBits(v[i]) & 0x7FFFFFFFu);
    }
  }
  plain = BlockMaxU32(plain);
  transformed = BlockMaxU32(transformed);
  if (threadIdx.x == 0) {
    if (plain_out != nullptr && plain != 0) atomicMax(plain_out, plain);
    if (transformed != 0) atomicMax(rht_out, transformed);
  }
}

// ------------------------------------------------------------------ pass 2

struct TileParams {
  int64_t rows = 0, cols = 0;
  const uint32_t* random = nullptr;  // rows x cols, or null (RNE)
  bool tile_2d = false;
  bool rht = false;
  const uint32_t* rht_sign_bits = nullptr;  // device word, low 16 bits used
  CopyOut row, col;
};

// Nibbles of codes encode(0..15): 0..7 into lo, 8..15 into hi (element 2j low in byte j).
template <typename Encode>
__device__ __forceinline__ void PackCodes(Encode encode, uint32_t& lo, uint32_t& hi) {
#pragma unroll
  for (int i = 0; i < 8; ++i) lo |= uint32_t(encode(i)) << (4 * i);
#pragma unroll
  for (int i = 0; i < 8; ++i) hi |= uint32_t(encode(i + 8)) << (4 * i);
}

// Quantizes one 16-value block of a copy held in v[] (values past the edge are 0): amax
// (combined over the 16 block rows of a tile through `amax_s` for tile_2d: entry [q][b] of
// the thread's block-row q and block b, 16 consecutive q per tile), scale byte, codes,
// packed store of `count` valid values at data + offset, scale store.
__device__ __forceinline__ void QuantizeBlock(const float (&v)[16], const uint32_t (&rnd)[16],
                                              bool stochastic, bool tile_2d, bool valid,
                                              uint32_t (*amax_s)[kBlocksPerRow], int q, int b,
                                              float S, int count, uint8_t* data,
                                              uint8_t* scale) {
  uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = max(amax, FloatBits(v[i]) & 0x7FFFFFFFu);
  if (tile_2d) {  // uniform across the CTA
    amax_s[q][b] = amax;
    __syncthreads();
    const int q0 = q & ~15;
#pragma unroll
    for (int k = 0; k < 16; ++k) amax = max(amax, amax_s[q0 + k][b]);
  }
  if (!valid) return;
  const uint8_t sd = Nvfp4BlockScaleByte(amax, S);
  const float factor = Nvfp4EncodeFactor(sd, S);
  // A block without NaN (factor not NaN) takes the cheap exact RNE path; one loop per path,
  // so that none branches per element.
  uint32_t lo = 0, hi = 0;
  if (stochastic) {
    PackCodes([&](int i) { return FloatToE2m1Stochastic(MulNanDefined(v[i], factor), rnd[i]); }, lo, hi);
  } else if (!IsNanBits(FloatBits(factor))) {
    PackCodes([&](int i) { return Nvfp4EncodeRneNonNanFactor(v[i], factor); }, lo, hi);
  } else {
    PackCodes([&](int i) { return Nvfp4E2m1Rne(MulNanDefined(v[i], factor)); }, lo, hi);
  }
  if (count < 16) {  // past the edge: nibble 0 (even where v * factor is NaN)
    lo &= count >= 8 ? 0xFFFFFFFFu : (1u << (4 * count)) - 1u;
    hi &= count <= 8 ? 0u : (1u << (4 * (count - 8))) - 1u;
  }
  if (count == 16 && (reinterpret_cast<uintptr_t>(data) & 7u) == 0) {
    *reinterpret_cast<uint2*>(data) = make_uint2(lo, hi);
  } else {
    const int nbytes = (count + 1) / 2;
    for (int j = 0; j < nbytes; ++j) data[j] = uint8_t((j < 4 ? lo >> (8 * j) : hi >> (8 * (j - 4))) & 0xFFu);
  }
  *scale = sd;
}

template <typename Tag>
__global__ void __launch_bounds__(kThreads) Nvfp4TileKernel(const typename Tag::Storage* __restrict__ x,
                                                           TileParams p, int64_t tiles_x) {
  using T = typename Tag::Storage;
  __shared__ float tile[kTile][kPitch];
  __shared__ uint32_t rnd_tile[kTile][kPitch];
  __shared__ uint32_t amax_s[kTile][kBlocksPerRow];
  // Consecutive CTAs take consecutive tiles of one 64-row band (x rows read in full lines).
  const int64_t r0 = int64_t(blockIdx.x) / tiles_x * kTile, c0 = int64_t(blockIdx.x) % tiles_x * kTile;
  const int tid = threadIdx.x;
  const bool stochastic = p.random != nullptr;

  // Stage x (and the random words) as fp32 / u32; elements past the edge are 0.
  constexpr int kVec = 16 / sizeof(T);
  const bool vec_x = p.cols % kVec == 0 && (reinterpret_cast<uintptr_t>(x) & 15u) == 0;
  if (vec_x) {
    for (int i = tid; i < kTile * kTile / kVec; i += kThreads) {
      const int tr = i / (kTile / kVec), tc = (i % (kTile / kVec)) * kVec;
      const int64_t r = r0 + tr, c = c0 + tc;
      T vals[kVec];
      if (r < p.rows && c < p.cols) {
        const uint4 packed = __ldg(reinterpret_cast<const uint4*>(x + r * p.cols + c));
        memcpy(vals, &packed, sizeof(packed));
      } else {
        memset(vals, 0, sizeof(vals));
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) tile[tr][tc + j] = LoadAsFloat(Tag{}, vals[j]);
    }
  } else {
    for (int i = tid; i < kTile * kTile; i += kThreads) {
      const int tr = i / kTile, tc = i % kTile;
      const int64_t r = r0 + tr, c = c0 + tc;
      tile[tr][tc] = (r < p.rows && c < p.cols) ? LoadAsFloat(Tag{}, x[r * p.cols + c]) : 0.0f;
    }
  }
  if (stochastic) {
    const bool vec_r = p.cols % 4 == 0 && (reinterpret_cast<uintptr_t>(p.random) & 15u) == 0;
    for (int i = tid; i < kTile * kTile / 4; i += kThreads) {
      const int tr = i / (kTile / 4), tc = (i % (kTile / 4)) * 4;
      const int64_t r = r0 + tr, c = c0 + tc;
      uint32_t w[4] = {0u, 0u, 0u, 0u};
      if (r < p.rows && vec_r && c < p.cols) {
        const uint4 packed = __ldg(reinterpret_cast<const uint4*>(p.random + r * p.cols + c));
        w[0] = packed.x, w[1] = packed.y, w[2] = packed.z, w[3] = packed.w;
      } else if (r < p.rows) {
#pragma unroll
        for (int j = 0; j < 4; ++j) w[j] = c + j < p.cols ? __ldg(p.random + r * p.cols + c + j) : 0u;
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) rnd_tile[tr][tc + j] = w[j];
    }
  }
  __syncthreads();

  float v[16];
  uint32_t rnd[16];
  // Rowwise: thread -> tile row tid / 4, block tid % 4 (4 neighbours write 32 contiguous bytes).
  if (p.row.data != nullptr) {
    const int q = tid / kBlocksPerRow, b = tid % kBlocksPerRow;
    const int64_t r = r0 + q, c = c0 + 16 * b;
    const float S = Nvfp4GlobalScale(*p.row.amax);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      v[i] = tile[q][16 * b + i];
      rnd[i] = stochastic ? rnd_tile[q][16 * b + i] : 0u;
    }
    const bool valid = r < p.rows && c < p.cols;
    const int count = valid ? int(p.cols - c < 16 ? p.cols - c : 16) : 0;
    QuantizeBlock(v, rnd, stochastic, p.tile_2d, valid, amax_s, q, b, S, count,
                  p.row.data + r * p.row.packed + c / 2, p.row.scale + r * p.row.scale_pitch + c / 16);
  }
  // Colwise: thread -> tile column tid / 4 (a row of Q), 16-row group tid % 4.
  if (p.col.data != nullptr) {
    if (p.tile_2d) __syncthreads();  // amax_s reused
    const int q = tid / kBlocksPerRow, g = tid % kBlocksPerRow;
    const int64_t c = c0 + q, r = r0 + 16 * g;  // Q row c, Q columns r .. r + 15
    const float S = Nvfp4GlobalScale(*p.col.amax);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      v[i] = tile[16 * g + i][q];
      rnd[i] = stochastic ? rnd_tile[16 * g + i][q] : 0u;
    }
    if (p.rht && r + 16 <= p.rows) Nvfp4Rht16(v, *p.rht_sign_bits & 0xFFFFu);
    const bool valid = c < p.cols && r < p.rows;
    const int count = valid ? int(p.rows - r < 16 ? p.rows - r : 16) : 0;
    QuantizeBlock(v, rnd, stochastic, p.tile_2d, valid, amax_s, q, g, S, count,
                  p.col.data + c * p.col.packed + r / 2, p.col.scale + c * p.col.scale_pitch + r / 16);
  }
}

// ------------------------------------------------------------------ pass 3

// Reads both amaxes before writing (they may be the same word).
__global__ void Nvfp4FinalizeKernel(const uint32_t* row_amax, float* row_out, const uint32_t* col_amax,
                                    float* col_out) {
  const uint32_t ra = row_amax != nullptr ? *row_amax : 0u;
  const uint32_t ca = col_amax != nullptr ? *col_amax : 0u;
  if (row_out != nullptr) *row_out = ScaleDivRn(1.0f, Nvfp4GlobalScale(ra));
  if (col_out != nullptr) *col_out = ScaleDivRn(1.0f, Nvfp4GlobalScale(ca));
}

template <typename Tag>
Status Launch(const QuantizeNvfp4Args& a, GpuStream stream) {
  using T = typename Tag::Storage;
  const bool want_row = a.rowwise != nullptr, want_col = a.colwise != nullptr;
  const auto* x = static_cast<const T*>(a.x);
  float* row_gsi = a.rowwise_global_scale_inv;
  float* col_gsi = a.colwise_global_scale_inv;

  // Pass 1.
  uint32_t* row_amax = reinterpret_cast<uint32_t*>(row_gsi);
  uint32_t* col_amax = reinterpret_cast<uint32_t*>(col_gsi);
  if (!(want_col && a.rht)) {
    float* out = want_row ? row_gsi : col_gsi;
    LOWBIT_RETURN_IF_ERROR(AmaxCuda(a.x, a.x_dtype, 1, a.rows * a.cols, out, stream));
    row_amax = col_amax = reinterpret_cast<uint32_t*>(out);
  } else {
    for (float* out : {row_gsi, col_gsi}) {
      if (out == nullptr) continue;
      LOWBIT_RETURN_IF_ERROR(
          CudaStatus(cudaMemsetAsync(out, 0, sizeof(float), stream), kOp, "cudaMemsetAsync"));
    }
    const int threads = 256;
    const int64_t groups = CeilDivI64(a.rows, 16);
    const int grid_x = int(CeilDivI64(a.cols, threads) < 65535 ? CeilDivI64(a.cols, threads) : 65535);
    int grid_y = GridStrideBlocks(groups * CeilDivI64(a.cols, threads), 1, 8) / grid_x;
    grid_y = grid_y < 1 ? 1 : (grid_y > groups ? int(groups) : grid_y);
    grid_y = grid_y > 65535 ? 65535 : grid_y;
    Nvfp4AmaxKernel<Tag><<<dim3(grid_x, grid_y), threads, 0, stream>>>(
        x, a.rows, a.cols, a.rht_sign_bits_device, want_row ? row_amax : nullptr, col_amax);
    LOWBIT_RETURN_IF_ERROR(LaunchStatus(kOp));
  }

  // Pass 2.
  TileParams p;
  p.rows = a.rows;
  p.cols = a.cols;
  p.random = a.random;
  p.tile_2d = a.tile_2d;
  p.rht = a.rht;
  p.rht_sign_bits = a.rht_sign_bits_device;
  if (want_row) {
    const ScaleDims d = Nvfp4ScaleDims(a.rows, a.cols);
    p.row = {a.rowwise, a.rowwise_scale, d.dim1, CeilDivI64(a.cols, 2), row_amax};
    LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(a.rowwise_scale, 0, size_t(d.size()), stream),
                                      kOp, "cudaMemsetAsync"));
  }
  if (want_col) {
    const ScaleDims d = Nvfp4ScaleDims(a.cols, a.rows);
    p.col = {a.colwise, a.colwise_scale, d.dim1, CeilDivI64(a.rows, 2), col_amax};
    LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(a.colwise_scale, 0, size_t(d.size()), stream),
                                      kOp, "cudaMemsetAsync"));
  }
  const int64_t tiles_y = CeilDivI64(a.rows, kTile), tiles_x = CeilDivI64(a.cols, kTile);
  if (tiles_y * tiles_x > 2147483647) {
    return Status::InvalidArgument(std::string(kOp) + ": x: " + std::to_string(a.rows) + " x " +
                                   std::to_string(a.cols) + " has more 64 x 64 tiles than a grid holds (2^31 - 1)");
  }
  Nvfp4TileKernel<Tag><<<unsigned(tiles_y * tiles_x), kThreads, 0, stream>>>(x, p, tiles_x);
  LOWBIT_RETURN_IF_ERROR(LaunchStatus(kOp));

  // Pass 3.
  Nvfp4FinalizeKernel<<<1, 1, 0, stream>>>(want_row ? row_amax : nullptr, row_gsi,
                                           want_col ? col_amax : nullptr, col_gsi);
  return LaunchStatus(kOp);
}

}  // namespace

Status QuantizeNvfp4Cuda(const QuantizeNvfp4Args& a, GpuStream stream) {
  if (a.rows * a.cols == 0) {  // A = 0, so S = 1: only the requested global scales are written
    Nvfp4FinalizeKernel<<<1, 1, 0, stream>>>(nullptr, a.rowwise_global_scale_inv, nullptr,
                                             a.colwise_global_scale_inv);
    return LaunchStatus(kOp);
  }
  if (a.rowwise == nullptr && a.colwise == nullptr) {
    return Status::InvalidArgument(std::string(kOp) + ": rowwise: neither copy requested");
  }
  if (a.rht && a.colwise != nullptr && a.rht_sign_bits_device == nullptr) {
    return Status::InvalidArgument(std::string(kOp) + ": rht_sign_bits: the CUDA launcher reads "
                                   "the sign word from device memory (rht_sign_bits_device)");
  }
  return DispatchHighPrecision(a.x_dtype, kOp, "x",
                               [&](auto tag) { return Launch<decltype(tag)>(a, stream); });
}

}  // namespace lowbit
