// CUDA executor of lowbit_dense_backward_fp8 (dense_backward.h): on one stream, the tiled FP8
// quantize kernel writing dy's copies where the plan places them (its dbias partials in dx's
// buffer or the scratch), then the dgrad (a = the rowwise segments' rows in dk, lda = dk's row
// pitch; equal segments as one batched cuBLASLt GEMM, which fills the GPU's last wave with
// both, else one GEMM each) and the wgrad (b = colwise slices, out = dk's column slices with
// ldd = n): slices 0 .. S/2-1 as one batched GEMM, then the others one by one. Host code
// only: no sync, nothing allocated.
#include "dense/dense_backward.h"

namespace lowbit {

Status DenseBwdCuda(const DenseBwdArgs& a, int device_ordinal, GpuStream stream) {
  DenseBwdPlan p;
  LOWBIT_RETURN_IF_ERROR(MakeDenseBwdPlanFor(a, int64_t(kGemmWorkspaceBytes), &p));
  const int64_t m = a.m, n = a.n, k = a.k, w = p.slice_rows;
  uint8_t* dk = static_cast<uint8_t*>(a.dk);

  Fp8CopyPlacement place;
  place.row_pitch = p.dk_pitch();
  place.row_segment_rows = k;
  place.row_segment_stride = n;
  place.slice_rows = w;
  for (int j = 0; j < p.slices; ++j) {
    place.slice_base[j] = (p.slice_in_scratch[j] ? a.scratch + p.scratch_colwise_offset : dk) + p.slice_offset[j];
    place.slice_pitch[j] = p.slice_pitch[j];
  }
  QuantizeFp8Args q = DenseBwdQuantizeArgs(a);
  q.rowwise = dk;
  q.colwise = place.slice_base[0];
  q.placement = &place;
  void* dbias_partials = p.dbias_in_dx ? a.dx : static_cast<void*>(a.scratch + p.scratch_dbias_offset);
  LOWBIT_RETURN_IF_ERROR(QuantizeFp8Cuda(q, dbias_partials, stream));

  void* workspace = a.scratch;  // kGemmWorkspaceBytes at the scratch's start

  // dgrad: dx rows [s k, s k + rows) = dy rowwise segment s . k_row^T.
  GemmArgs g = DenseBwdDgradArgs(a);
  g.lda = p.dk_pitch();
  if (m == p.row_segments * k && p.row_segments > 1) {  // segment s: a + s n, out + s k rows
    g.a = dk;
    g.m = k;
    g.out = a.dx;
    g.batch = int32_t(p.row_segments);
    g.batch_stride_a = n;
    g.batch_stride_b = 0;
    g.batch_stride_d = k * k;
    LOWBIT_RETURN_IF_ERROR(GemmCuda(g, device_ordinal, workspace, stream));
  } else {
    for (int64_t s = 0; s < p.row_segments; ++s) {
      g.a = dk + s * n;
      g.m = std::min(k, m - s * k);
      g.out = static_cast<uint8_t*>(a.dx) + s * k * k * p.dx_elem;
      LOWBIT_RETURN_IF_ERROR(GemmCuda(g, device_ordinal, workspace, stream));
    }
  }

  // wgrad slice j: dk[:, j w : (j+1) w] = x_col . colwise slice j^T.
  g = DenseBwdWgradArgs(a);
  g.n = w;
  g.ldd = n;
  const int half = p.slices / 2;
  bool uniform = half > 1;  // slices 0 .. half-1 a host apart, as the plan puts them
  for (int j = 1; j < half; ++j) {
    uniform = uniform && !p.slice_in_scratch[j] && p.slice_offset[j] == p.slice_offset[0] + j * w * p.dk_elem;
  }
  int j = 0;
  if (uniform) {  // slice j: b + j w dk_elem bytes (fp8 elements), out + j w elements
    g.b = place.slice_base[0];
    g.ldb = p.slice_pitch[0];
    g.out = dk;
    g.batch = half;
    g.batch_stride_b = w * p.dk_elem;
    g.batch_stride_d = w;
    LOWBIT_RETURN_IF_ERROR(GemmCuda(g, device_ordinal, workspace, stream));
    g.batch = 1;
    g.batch_stride_b = g.batch_stride_d = 0;
    j = half;
  }
  for (; j < p.slices; ++j) {
    g.b = place.slice_base[j];
    g.ldb = p.slice_pitch[j];
    g.out = dk + j * w * p.dk_elem;
    LOWBIT_RETURN_IF_ERROR(GemmCuda(g, device_ordinal, workspace, stream));
  }
  return Status::Ok();
}

}  // namespace lowbit
