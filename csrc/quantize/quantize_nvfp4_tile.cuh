// The NVFP4 tile code shared by the plain quantizer (quantize_nvfp4.cu) and the grouped one
// (quantize_grouped_nvfp4.cu), so that every NVFP4 copy comes from one implementation
// (numerics and layouts: quantize_nvfp4.h):
//   Amax16        one 16-row group of one column: plain and RHT-transformed amax (pass 1).
//   QuantizeTile  one 64 x 64 tile of x (and of the random words) per CTA, staged as fp32 in
//                 shared memory with 16-byte loads; 256 threads, each quantizing one 16-value
//                 block of the rowwise copy (a row segment) and one of the colwise copy (a
//                 column segment, RHT'd in registers), writing its 8 packed bytes and its scale
//                 byte; tile_2d amaxes are combined over 16 threads through shared memory. The
//                 copy's rows x cols are TileParams' (a group's rows for the grouped quantizer:
//                 x, random and the outputs then point at the group's first row and slots).
// Every rounding step is quantize_nvfp4.h's LOWBIT_HD code (correctly rounded division, no FMA
// contraction), so the bits equal the CPU reference's; RNE encodes go through
// Nvfp4EncodeRneNonNanFactor, the cheaper exact twin of Nvfp4Encode for blocks without NaN.
#pragma once

#include <cuda_runtime.h>

#include <cstring>

#include "common/element.h"
#include "quantize/quantize_nvfp4.h"

namespace lowbit {
namespace nvfp4_tile {

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

// One 16-row group of column c of x (rows x cols) from row r0 (values past `rows` are 0):
// plain gets max |x|, transformed max |T v| when rht and the group is full (16 rows), else
// max |x| too.
template <typename Tag>
__device__ __forceinline__ void Amax16(const typename Tag::Storage* __restrict__ x, int64_t rows, int64_t cols,
                                       int64_t r0, int64_t c, bool rht, uint32_t sign_bits, uint32_t& plain,
                                       uint32_t& transformed) {
  const bool full = r0 + 16 <= rows;
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    v[i] = (full || r0 + i < rows) ? LoadAsFloat(Tag{}, x[(r0 + i) * cols + c]) : 0.0f;
    plain = max(plain, FloatBits(v[i]) & 0x7FFFFFFFu);
  }
  if (rht && full) Nvfp4Rht16(v, sign_bits);
#pragma unroll
  for (int i = 0; i < 16; ++i) transformed = max(transformed, FloatBits(v[i]) & 0x7FFFFFFFu);
}

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

// Quantizes the 64 x 64 tile of x at (r0, c0) into both requested copies of p (every thread
// of the CTA calls it; all of it is the body of the plain kernel, Nvfp4TileKernel).
template <typename Tag>
__device__ __forceinline__ void QuantizeTile(const typename Tag::Storage* __restrict__ x, const TileParams& p,
                                             int64_t r0, int64_t c0) {
  using T = typename Tag::Storage;
  __shared__ float tile[kTile][kPitch];
  __shared__ uint32_t rnd_tile[kTile][kPitch];
  __shared__ uint32_t amax_s[kTile][kBlocksPerRow];
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

}  // namespace nvfp4_tile
}  // namespace lowbit
