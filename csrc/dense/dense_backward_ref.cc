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

int64_t ElemBytes(DType t) { return t == DType::kF32 ? 4 : 2; }

// Where dy's colwise slice j starts (its rows are slice_pitch[j] bytes apart).
uint8_t* SliceBase(const DenseBwdPlan& p, const DenseBwdArgs& a, int j) {
  uint8_t* base = p.slice_in_scratch[j] ? a.scratch + p.scratch_colwise_offset : static_cast<uint8_t*>(a.dk);
  return base + p.slice_offset[j];
}

}  // namespace

Status DenseBwdRef(const DenseBwdArgs& a) {
  DenseBwdPlan p;
  LOWBIT_RETURN_IF_ERROR(
      MakeDenseBwdPlan(a.m, a.n, a.k, ElemBytes(a.dk_dtype), ElemBytes(a.dx_dtype), a.dbias != nullptr, 0, &p));
  const int64_t m = a.m, n = a.n, k = a.k, w = p.slice_rows, ek = p.dk_elem;
  uint8_t* dk = static_cast<uint8_t*>(a.dk);

  // 1. dy's copies, amax and dbias; then the rowwise rows into dk's left half and the
  //    colwise slices into their hosts (or the scratch).
  {
    std::vector<uint8_t> rowwise(size_t(m * n)), colwise(size_t(n * m));
    QuantizeFp8Args q;
    q.x = a.dy;
    q.x_dtype = a.dy_dtype;
    q.rows = m;
    q.cols = n;
    q.scale = a.dy_scale;
    q.out_dtype = a.q_dtype;
    q.rowwise = rowwise.data();
    q.colwise = colwise.data();
    q.amax = a.amax;
    q.dbias = a.dbias;
    q.dbias_dtype = a.dbias_dtype;
    LOWBIT_RETURN_IF_ERROR(QuantizeFp8Ref(q));
    for (int64_t r = 0; r < m; ++r) std::memcpy(dk + p.RowwiseOffset(r), rowwise.data() + r * n, size_t(n));
    for (int j = 0; j < p.slices; ++j) {
      for (int64_t r = 0; r < w; ++r) {
        std::memcpy(SliceBase(p, a, j) + r * p.slice_pitch[j], colwise.data() + (j * w + r) * m, size_t(m));
      }
    }
  }

  GemmArgs g;
  g.a_scale_mode = g.b_scale_mode = GemmScaleMode::kTensor;
  g.use_split_accumulator = true;

  // 2. dgrad: dx (m, k) = dy rowwise (m, n) . k_row (k, n)^T.
  {
    std::vector<uint8_t> rowwise(size_t(m * n));
    for (int64_t r = 0; r < m; ++r) std::memcpy(rowwise.data() + r * n, dk + p.RowwiseOffset(r), size_t(n));
    g.a = rowwise.data();
    g.a_type = a.q_dtype;
    g.a_scale_inv = a.dy_scale_inv;
    g.b = a.k_row;
    g.b_type = a.k_dtype;
    g.b_scale_inv = a.k_scale_inv;
    g.out = a.dx;
    g.out_type = a.dx_dtype;
    g.m = m, g.n = k, g.k = n;
    LOWBIT_RETURN_IF_ERROR(GemmRef(g));
  }

  // 3. wgrad slice j: dk[:, j w : (j+1) w] = x_col (k, m) . colwise slice j (w, m)^T.
  std::vector<uint8_t> slice(size_t(w * m)), out(size_t(k * w * ek));
  for (int j = 0; j < p.slices; ++j) {
    for (int64_t r = 0; r < w; ++r) {
      std::memcpy(slice.data() + r * m, SliceBase(p, a, j) + r * p.slice_pitch[j], size_t(m));
    }
    g.a = a.x_col;
    g.a_type = a.x_dtype;
    g.a_scale_inv = a.x_scale_inv;
    g.b = slice.data();
    g.b_type = a.q_dtype;
    g.b_scale_inv = a.dy_scale_inv;
    g.out = out.data();
    g.out_type = a.dk_dtype;
    g.m = k, g.n = w, g.k = m;
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
