// dense_backward: the backward of a per-tensor FP8 dense layer as one op that keeps dy's FP8
// copies inside its own outputs, so that the step needs no temporary memory for them.
//
//   dy (m, n) f32/f16/bf16 -> rowwise (m, n) and colwise (n, m) FP8 copies (+ amax, dbias),
//   dx (m, k) = dy . kernel^T = gemm(dy rowwise, k_row)          k_row (k, n) FP8
//   dk (k, n) = x^T . dy      = gemm(x_col, dy colwise)           x_col (k, m) FP8
// with lowbit_quantize_fp8's numerics for dy and lowbit_gemm's for the two GEMMs (each with
// split accumulation or, where dgrad_split / wgrad_split say so, fast); the values equal the
// unfused ops' (quantize.h, gemm.h).
//
// Placement (DenseBwdPlan): unfused, dy's two copies (2 m n bytes) live beside dk and dx. Here
// they live in dk's own buffer (4 k n bytes for an f32 dk) until the GEMMs overwrite it:
//   - dy's rowwise copy in the left half of dk's rows: dy row r at byte (r % k) * pitch +
//     (r / k) * n of dk, pitch = n * dk_elem (ceil(m / k) segments side by side; needs
//     m <= k * dk_elem / 2);
//   - dy's colwise copy cut into S slices of w = n / S rows; wgrad slice j writes dk's
//     columns [j w, (j+1) w). Slices 0 .. S-2 live in dk's right half (the "hosts", column
//     slices S/2 .. S-1 of dk, each holding up to two colwise slices as w-row blocks in
//     slots 0 and 1, one colwise row per dk row): slice j < S/2 in host S/2 + j slot 1 (slot
//     0 when S = 2), slice j >= S/2 in host j + 1 slot 0. Slice S-1 lives in the scratch.
// Order on one stream: quantize dy (dbias partials in dx's buffer, which the dgrad writes
// later); the dgrad (the rowwise segments as one batched GEMM when they are equal, else one
// GEMM each); the wgrad of slices 0 .. S/2-1 as one batched GEMM (they write dk's left half,
// free after the dgrad, and read the hosts at a uniform stride); then slices S/2 .. S-1 one
// after another, each host written only after the slices it holds have been consumed.
// So the op's memory beyond its inputs and outputs is its scratch: one colwise slice (w m
// bytes) and, on CUDA, the cuBLASLt workspace, where the unfused ops need 2 m n bytes of copies.
// MakeDenseBwdPlan picks the smallest S in {2, 4, 8, 16} whose slices fit (w a multiple of
// 128, m <= w * dk_elem, the rows each host needs <= k) and says why when none does; the
// caller (lowbit.dense) then runs the unfused ops. Batched or not, the GEMMs compute the same
// products (one batch entry per segment or slice).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/gpu_stream.h"
#include "common/status.h"
#include "gemm/gemm.h"
#include "quantize/quantize.h"

namespace lowbit {

constexpr const char* kDenseBwdOp = "lowbit_dense_backward_fp8";
constexpr int kDenseBwdMaxSlices = 16;
constexpr int64_t kDenseBwdAlign = 256;  // scratch regions start at multiples of this

struct DenseBwdPlan {
  int64_t m = 0, n = 0, k = 0;
  int64_t dk_elem = 4, dx_elem = 2;  // bytes per element of dk and dx
  int32_t slices = 0;                // S
  int64_t slice_rows = 0;            // w = n / S colwise rows (dy columns) per slice
  int64_t row_segments = 0;          // ceil(m / k)
  // Colwise slice j: rows at base + slice_offset[j] + r * slice_pitch[j], base = dk (slice in
  // a host) or the scratch's colwise area (slice_in_scratch[j]).
  bool slice_in_scratch[kDenseBwdMaxSlices] = {};
  int64_t slice_offset[kDenseBwdMaxSlices] = {};
  int64_t slice_pitch[kDenseBwdMaxSlices] = {};
  bool dbias_in_dx = true;  // the dbias partials (QuantizeFp8WorkspaceBytes) in dx's buffer
  // Scratch result: [GEMM workspace (CUDA) | colwise slice S-1 | dbias partials unless in dx].
  int64_t scratch_colwise_offset = 0, scratch_dbias_offset = 0, scratch_bytes = 0;

  int64_t dk_pitch() const { return n * dk_elem; }
  // Byte offset in dk of dy's rowwise row r.
  int64_t RowwiseOffset(int64_t r) const { return (r % k) * dk_pitch() + (r / k) * n; }
};

// A rectangle of dk's buffer seen as k rows of dk_pitch bytes: rows [r0, r1), bytes [b0, b1).
struct DkRect {
  int64_t r0, r1, b0, b1;
  bool Overlaps(const DkRect& o) const { return r0 < o.r1 && o.r0 < r1 && b0 < o.b1 && o.b0 < b1; }
};

// Checks the plan's schedule on dk's buffer: dy's placed pieces are disjoint and inside dk, and
// no GEMM launch writes over a piece that it or a later launch reads (the dgrad reads the
// rowwise segments and writes only dx; the batched launch of slices 0 .. S/2-1 writes dk's left
// half; wgrad j >= S/2 reads slice j and writes dk's columns [j w, (j+1) w)). MakeDenseBwdPlan
// runs it on every plan it returns.
inline Status CheckDenseBwdPlan(const DenseBwdPlan& p) {
  const std::string op = std::string(kDenseBwdOp) + ": internal: plan ";
  const int64_t w = p.slice_rows;
  std::vector<DkRect> pieces;  // rowwise segments, then the slices held in dk (index j + segments)
  for (int64_t s = 0; s < p.row_segments; ++s) {
    pieces.push_back({0, std::min(p.k, p.m - s * p.k), s * p.n, (s + 1) * p.n});
  }
  std::vector<int> slice_piece(size_t(p.slices), -1);
  for (int j = 0; j < p.slices; ++j) {
    if (p.slice_in_scratch[j]) continue;
    const int64_t r0 = p.slice_offset[j] / p.dk_pitch(), b0 = p.slice_offset[j] % p.dk_pitch();
    if (p.slice_pitch[j] != p.dk_pitch()) return Status::Internal(op + "slice pitch");
    slice_piece[size_t(j)] = int(pieces.size());
    pieces.push_back({r0, r0 + w, b0, b0 + p.m});
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    const DkRect& a = pieces[i];
    if (a.r0 < 0 || a.r1 > p.k || a.b0 < 0 || a.b1 > p.dk_pitch()) return Status::Internal(op + "piece outside dk");
    for (size_t j = i + 1; j < pieces.size(); ++j) {
      if (a.Overlaps(pieces[j])) return Status::Internal(op + "pieces overlap");
    }
  }
  for (int j = p.slices / 2 - 1; j < p.slices; ++j) {  // the batched launch (as j = S/2-1), then each j
    const int64_t first_col = j < p.slices / 2 ? 0 : j * w;
    const DkRect written{0, p.k, first_col * p.dk_elem, (j + 1) * w * p.dk_elem};
    for (int later = j < p.slices / 2 ? 0 : j; later < p.slices; ++later) {
      const int piece = slice_piece[size_t(later)];
      if (piece >= 0 && written.Overlaps(pieces[size_t(piece)])) {
        return Status::Internal(op + "wgrad " + std::to_string(j) + " overwrites slice " + std::to_string(later));
      }
    }
  }
  return Status::Ok();
}

inline int64_t DenseBwdRoundUp(int64_t bytes) {
  return (bytes + kDenseBwdAlign - 1) / kDenseBwdAlign * kDenseBwdAlign;
}

// Fills `plan` for dy (m, n), dk (k, n) of dk_elem bytes and dx (m, k) of dx_elem bytes, the
// scratch starting with gemm_workspace_bytes (kGemmWorkspaceBytes on CUDA, 0 on the CPU), or
// returns InvalidArgument saying why no plan fits (the caller falls back to the unfused ops).
inline Status MakeDenseBwdPlan(int64_t m, int64_t n, int64_t k, int64_t dk_elem, int64_t dx_elem,
                               bool dbias, int64_t gemm_workspace_bytes, DenseBwdPlan* plan) {
  const std::string op = std::string(kDenseBwdOp) + ": ";
  *plan = DenseBwdPlan{};
  if (m <= 0 || n <= 0 || k <= 0 || m % 16 != 0 || n % 16 != 0 || k % 16 != 0) {
    return Status::InvalidArgument(op + "m, n, k: expected positive multiples of 16, got " + std::to_string(m) +
                                   ", " + std::to_string(n) + ", " + std::to_string(k));
  }
  if (m >= (int64_t(1) << 31) || n >= (int64_t(1) << 31)) {
    return Status::InvalidArgument(op + "m, n: expected < 2^31");
  }
  if ((dk_elem != 2 && dk_elem != 4) || (dx_elem != 2 && dx_elem != 4)) {
    return Status::InvalidArgument(op + "dk, dx: expected 2- or 4-byte elements");
  }
  const int64_t segments = (m + k - 1) / k;
  if (segments * 2 > dk_elem) {
    return Status::InvalidArgument(op + "dy's rowwise copy does not fit dk's left half (m = " + std::to_string(m) +
                                   " > " + std::to_string(dk_elem / 2) + " * k = " + std::to_string(k) + ")");
  }
  for (int32_t s = 2; s <= kDenseBwdMaxSlices; s *= 2) {
    const int64_t w = n / s;
    if (n % s != 0 || w % kQuantizeTileCols != 0 || m > w * dk_elem) continue;
    // Hosts are dk column slices s/2 .. s-1, each with slots 0 and 1 of w dk rows: slice
    // j >= s/2 in host j + 1 slot 0, slice j < s/2 in host s/2 + j slot 1 (0 for s = 2, whose
    // one host holds nothing else), so that those slices lie a host apart for the batched
    // launch; slice s-1 in the scratch.
    int host_of[kDenseBwdMaxSlices], slot_of[kDenseBwdMaxSlices];
    for (int32_t j = 0; j < s - 1; ++j) {
      host_of[j] = j < s / 2 ? s / 2 + j : j + 1;
      slot_of[j] = j < s / 2 && s > 2 ? 1 : 0;
    }
    if ((s > 2 ? 2 : 1) * w > k) continue;
    DenseBwdPlan& p = *plan;
    p.m = m, p.n = n, p.k = k, p.dk_elem = dk_elem, p.dx_elem = dx_elem;
    p.slices = s;
    p.slice_rows = w;
    p.row_segments = segments;
    for (int32_t j = 0; j < s - 1; ++j) {
      p.slice_offset[j] = host_of[j] * w * dk_elem + slot_of[j] * w * p.dk_pitch();
      p.slice_pitch[j] = p.dk_pitch();
    }
    p.slice_in_scratch[s - 1] = true;
    p.slice_pitch[s - 1] = m;
    const int64_t dbias_bytes = QuantizeFp8WorkspaceBytes(m, n, dbias);
    p.dbias_in_dx = dbias_bytes <= m * k * dx_elem;
    p.scratch_colwise_offset = DenseBwdRoundUp(gemm_workspace_bytes);
    p.scratch_dbias_offset = p.scratch_colwise_offset + DenseBwdRoundUp(w * m);
    p.scratch_bytes = p.scratch_dbias_offset + (p.dbias_in_dx ? 0 : DenseBwdRoundUp(dbias_bytes));
    return CheckDenseBwdPlan(p);
  }
  return Status::InvalidArgument(op + "no slicing of dy's colwise copy fits dk (m " + std::to_string(m) + ", n " +
                                 std::to_string(n) + ", k " + std::to_string(k) + ")");
}

struct DenseBwdArgs {
  const void* dy = nullptr;  // (m, n), dy_dtype
  DType dy_dtype = DType::kInvalid;
  const uint8_t* x_col = nullptr;  // (k, m) FP8, x_dtype
  DType x_dtype = DType::kInvalid;
  const uint8_t* k_row = nullptr;  // (k, n) FP8, k_dtype
  DType k_dtype = DType::kInvalid;
  DType q_dtype = DType::kInvalid;  // dy's copies: kE4M3 or kE5M2
  const float* dy_scale = nullptr;  // one f32 each (host for the reference, device for CUDA)
  const float* dy_scale_inv = nullptr;
  const float* x_scale_inv = nullptr;
  const float* k_scale_inv = nullptr;
  void* dx = nullptr;  // (m, k), dx_dtype
  DType dx_dtype = DType::kInvalid;
  void* dk = nullptr;  // (k, n), dk_dtype
  DType dk_dtype = DType::kInvalid;
  void* dbias = nullptr;  // (n,), dbias_dtype, or null
  DType dbias_dtype = DType::kInvalid;
  float* amax = nullptr;  // dy's amax, one f32
  uint8_t* scratch = nullptr;  // plan.scratch_bytes, 256-byte aligned
  int64_t m = 0, n = 0, k = 0;
  // cuBLASLt heuristic indices of the dgrad and the wgrad launches (GemmArgs::algo; the
  // unfused ops' lowbit.ops.gemm kinds, LOWBIT_GEMM_ALGO): the reference ignores them.
  int32_t dgrad_algo = 0, wgrad_algo = 0;
  // GemmArgs::use_split_accumulator of the dgrad and the wgrad (lowbit.dense's
  // GemmAccumulation; false = Hopper's fast FP8 accumulation): the reference ignores them.
  bool dgrad_split = true, wgrad_split = true;
  // GemmArgs::algo_or_first of the dgrad and the wgrad (the index is a library default).
  bool dgrad_algo_or_first = false, wgrad_algo_or_first = false;
};

// The pieces both executors start from: the plan for `a` (gemm_workspace_bytes as in
// MakeDenseBwdPlan), dy's quantize arguments without the copies' destinations, and the two
// GEMMs' arguments without operand pointers, shapes and leading dimensions.
inline Status MakeDenseBwdPlanFor(const DenseBwdArgs& a, int64_t gemm_workspace_bytes, DenseBwdPlan* plan) {
  auto bytes = [](DType t) { return int64_t(t == DType::kF32 ? 4 : 2); };
  return MakeDenseBwdPlan(a.m, a.n, a.k, bytes(a.dk_dtype), bytes(a.dx_dtype), a.dbias != nullptr,
                          gemm_workspace_bytes, plan);
}

inline QuantizeFp8Args DenseBwdQuantizeArgs(const DenseBwdArgs& a) {
  QuantizeFp8Args q;
  q.x = a.dy;
  q.x_dtype = a.dy_dtype;
  q.rows = a.m;
  q.cols = a.n;
  q.scale = a.dy_scale;
  q.out_dtype = a.q_dtype;
  q.amax = a.amax;
  q.dbias = a.dbias;
  q.dbias_dtype = a.dbias_dtype;
  return q;
}

// dgrad: a = dy's rowwise copy, b = k_row, out = dx (accumulated as dgrad_split says).
inline GemmArgs DenseBwdDgradArgs(const DenseBwdArgs& a) {
  GemmArgs g;
  g.a_type = a.q_dtype;
  g.a_scale_inv = a.dy_scale_inv;
  g.b = a.k_row;
  g.b_type = a.k_dtype;
  g.b_scale_inv = a.k_scale_inv;
  g.out_type = a.dx_dtype;
  g.n = a.k, g.k = a.n;
  g.algo = a.dgrad_algo;
  g.algo_or_first = a.dgrad_algo_or_first;
  g.use_split_accumulator = a.dgrad_split;
  return g;
}

// wgrad: a = x_col, b = a colwise slice of dy, out = dk's columns (m = k, k = m; n per slice).
inline GemmArgs DenseBwdWgradArgs(const DenseBwdArgs& a) {
  GemmArgs g;
  g.a = a.x_col;
  g.a_type = a.x_dtype;
  g.a_scale_inv = a.x_scale_inv;
  g.b_type = a.q_dtype;
  g.b_scale_inv = a.dy_scale_inv;
  g.out_type = a.dk_dtype;
  g.m = a.k, g.k = a.m;
  g.algo = a.wgrad_algo;
  g.algo_or_first = a.wgrad_algo_or_first;
  g.use_split_accumulator = a.wgrad_split;
  return g;
}

// The CPU reference (dense_backward_ref.cc): the plan executed in the same buffers and order,
// with QuantizeFp8Ref and GemmRef on dense copies gathered from / scattered to the placed ones.
Status DenseBwdRef(const DenseBwdArgs& args);
// CUDA (dense_backward_cuda.cc): the placed quantize kernel, then cuBLASLt GEMMs with leading
// dimensions, on `stream` of device `device_ordinal`.
Status DenseBwdCuda(const DenseBwdArgs& args, int device_ordinal, GpuStream stream);

}  // namespace lowbit

// For Python (lowbit/ops/dense_backward.py, through ctypes): the plan's slice count and
// scratch bytes (cuda != 0: with the cuBLASLt workspace), or 0 and a negative return when
// none fits.
extern "C" int32_t LowbitDenseBackwardPlan(int64_t m, int64_t n, int64_t k, int64_t dk_elem, int64_t dx_elem,
                                           int32_t dbias, int32_t cuda, int32_t* slices, int64_t* scratch_bytes);
