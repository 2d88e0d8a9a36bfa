// CPU reference of lowbit_dense_backward_fp8 (dense_backward.h): the plan executed in the
// caller's dx, dk and scratch buffers, in the CUDA executor's order. dy's copies come from
// QuantizeFp8Ref and are scattered to their placed rows; each GEMM gathers its placed
// operand into a dense copy for GemmRef. A plan that let a step overwrite an operand a later
// step reads would therefore give wrong values here too, which the tests compare with the
// unfused ops.
#include <cstring>
#include <vector>

#include "dense/dense_backward.h"

namespace lowbit {
namespace {

// Where dy's colwise slice j starts (its rows are slice_pitch[j] bytes apart).
uint8_t* SliceBase(const DenseBwdPlan& p, const DenseBwdArgs& a, int j) {
  uint8_t* base = p.slice_in_scratch[j] ? a.scratch + p.scratch_colwise_offset : static_cast<uint8_t*>(a.dk);
  return base + p.slice_offset[j];
}

}  // namespace

Status DenseBwdRef(const DenseBwdArgs& a) {
  DenseBwdPlan p;
  LOWBIT_RETURN_IF_ERROR(MakeDenseBwdPlanFor(a, 0, &p));
  const int64_t m = a.m, n = a.n, k = a.k, w = p.slice_rows, ek = p.dk_elem;
  uint8_t* dk = static_cast<uint8_t*>(a.dk);

  // 1. dy's copies, amax and dbias; then the rowwise rows into dk's left half and the
  //    colwise slices into their hosts (or the scratch).
  {
    std::vector<uint8_t> rowwise(size_t(m * n)), colwise(size_t(n * m));
    QuantizeFp8Args q = DenseBwdQuantizeArgs(a);
    q.rowwise = rowwise.data();
    q.colwise = colwise.data();
    LOWBIT_RETURN_IF_ERROR(QuantizeFp8Ref(q));
    for (int64_t r = 0; r < m; ++r) std::memcpy(dk + p.RowwiseOffset(r), rowwise.data() + r * n, size_t(n));
    for (int j = 0; j < p.slices; ++j) {
      for (int64_t r = 0; r < w; ++r) {
        std::memcpy(SliceBase(p, a, j) + r * p.slice_pitch[j], colwise.data() + (j * w + r) * m, size_t(m));
      }
    }
  }

  // 2. dgrad: dx (m, k) = dy rowwise (m, n) . k_row (k, n)^T.
  {
    std::vector<uint8_t> rowwise(size_t(m * n));
    for (int64_t r = 0; r < m; ++r) std::memcpy(rowwise.data() + r * n, dk + p.RowwiseOffset(r), size_t(n));
    GemmArgs g = DenseBwdDgradArgs(a);
    g.a = rowwise.data();
    g.out = a.dx;
    g.m = m;
    LOWBIT_RETURN_IF_ERROR(GemmRef(g));
  }

  // 3. wgrad slice j: dk[:, j w : (j+1) w] = x_col (k, m) . colwise slice j (w, m)^T.
  std::vector<uint8_t> slice(size_t(w * m)), out(size_t(k * w * ek));
  GemmArgs g = DenseBwdWgradArgs(a);
  g.b = slice.data();
  g.out = out.data();
  g.n = w;
  for (int j = 0; j < p.slices; ++j) {
    for (int64_t r = 0; r < w; ++r) {
      std::memcpy(slice.data() + r * m, SliceBase(p, a, j) + r * p.slice_pitch[j], size_t(m));
    }
    LOWBIT_RETURN_IF_ERROR(GemmRef(g));
    for (int64_t r = 0; r < k; ++r) {
      std::memcpy(dk + r * p.dk_pitch() + j * w * ek, out.data() + r * w * ek, size_t(w * ek));
    }
  }
  return Status::Ok();
}

}  // namespace lowbit

extern "C" __attribute__((visibility("default"))) int32_t LowbitDenseBackwardPlan(
    int64_t m, int64_t n, int64_t k, int64_t dk_elem, int64_t dx_elem, int32_t dbias, int32_t cuda, int32_t* slices,
    int64_t* scratch_bytes) {
  lowbit::DenseBwdPlan p;
  const lowbit::Status s = lowbit::MakeDenseBwdPlan(
      m, n, k, dk_elem, dx_elem, dbias != 0, cuda != 0 ? int64_t(lowbit::kGemmWorkspaceBytes) : 0, &p);
  *slices = s.ok() ? p.slices : 0;
  *scratch_bytes = s.ok() ? p.scratch_bytes : 0;
  return s.ok() ? 0 : -1;
}
