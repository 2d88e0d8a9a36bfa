// The fused dense backward's planner (dense_backward.h): the slice counts it picks, the seed
// Dense's layout, a sweep of sizes whose every plan passes CheckDenseBwdPlan (run inside
// MakeDenseBwdPlan), and the check catching broken plans.
#include <gtest/gtest.h>

#include <cstdint>
#include <utility>

#include "dense/dense_backward.h"

namespace lowbit {
namespace {

TEST(DenseBwdPlan, SeedDense) {
  DenseBwdPlan p;  // 8 x 2048 tokens, 8192 -> 32768, f32 kernel, bf16 dx
  ASSERT_TRUE(MakeDenseBwdPlan(16384, 32768, 8192, 4, 2, true, int64_t(kGemmWorkspaceBytes), &p).ok());
  EXPECT_EQ(p.slices, 8);
  EXPECT_EQ(p.slice_rows, 4096);
  EXPECT_EQ(p.row_segments, 2);
  EXPECT_EQ(p.RowwiseOffset(8192 + 3), 3 * 32768 * 4 + 32768);  // segment 1, row 3
  // Slices 0 .. 3 in hosts 4 .. 7 slot 1, 4 .. 6 in hosts 5 .. 7 slot 0, 7 in the scratch.
  for (int j = 0; j < 4; ++j) EXPECT_EQ(p.slice_offset[j], (4 + j) * 4096 * 4 + 4096 * p.dk_pitch());
  for (int j = 4; j < 7; ++j) EXPECT_EQ(p.slice_offset[j], (j + 1) * 4096 * 4);
  EXPECT_TRUE(p.slice_in_scratch[7]);
  EXPECT_TRUE(p.dbias_in_dx);
  EXPECT_EQ(p.scratch_bytes, int64_t(kGemmWorkspaceBytes) + 4096 * 16384);
}

TEST(DenseBwdPlan, EveryPlanOfASweepPassesTheCheck) {
  int planned = 0;
  for (int64_t m : {16, 128, 512, 1024, 4096}) {
    for (int64_t n : {128, 256, 1024, 2048, 4096, 8192}) {
      for (int64_t k : {16, 256, 512, 2048, 4096}) {
        for (int64_t dk_elem : {2, 4}) {
          DenseBwdPlan p;
          const Status s = MakeDenseBwdPlan(m, n, k, dk_elem, 2, true, 0, &p);
          if (!s.ok()) {
            EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
            continue;
          }
          ++planned;
          EXPECT_TRUE(CheckDenseBwdPlan(p).ok());
          EXPECT_LE(p.row_segments * p.n, p.n * dk_elem / 2);
          EXPECT_EQ(p.slices * p.slice_rows, n);
        }
      }
    }
  }
  EXPECT_GT(planned, 40);
}

TEST(DenseBwdPlan, CheckCatchesBrokenPlans) {
  DenseBwdPlan p;
  ASSERT_TRUE(MakeDenseBwdPlan(512, 1024, 256, 4, 2, false, 0, &p).ok());
  ASSERT_EQ(p.slices, 8);
  DenseBwdPlan own = p;  // slice 5 in its own host: wgrad 5 would overwrite it
  own.slice_offset[5] = 5 * p.slice_rows * 4;
  EXPECT_EQ(CheckDenseBwdPlan(own).code(), StatusCode::kInternal);
  DenseBwdPlan early = p;  // slices 4 and 6 swapped: host 5 written by wgrad 5 before wgrad 6 reads it
  std::swap(early.slice_offset[4], early.slice_offset[6]);
  EXPECT_EQ(CheckDenseBwdPlan(early).code(), StatusCode::kInternal);
  DenseBwdPlan host4 = p;  // slice 6 in host 4's free slot 0: wgrad 4 writes it before wgrad 6
  host4.slice_offset[6] = 4 * p.slice_rows * 4;
  EXPECT_EQ(CheckDenseBwdPlan(host4).code(), StatusCode::kInternal);
  DenseBwdPlan host4_slice0 = p;  // slice 0 there instead: the batched launch reads it before wgrad 4
  host4_slice0.slice_offset[0] = 4 * p.slice_rows * 4;
  EXPECT_TRUE(CheckDenseBwdPlan(host4_slice0).ok());
  DenseBwdPlan own4 = p;  // slice 4 there: wgrad 4 would write its own operand
  own4.slice_offset[4] = 4 * p.slice_rows * 4;
  EXPECT_EQ(CheckDenseBwdPlan(own4).code(), StatusCode::kInternal);
  DenseBwdPlan left = p;  // slice 6 in dk's left half: the batched launch overwrites it
  left.slice_offset[6] = 2 * p.n;
  EXPECT_EQ(CheckDenseBwdPlan(left).code(), StatusCode::kInternal);
  DenseBwdPlan rowwise = p;  // slice 0 over the rowwise segments
  rowwise.slice_offset[0] = 0;
  EXPECT_EQ(CheckDenseBwdPlan(rowwise).code(), StatusCode::kInternal);
}

TEST(DenseBwdPlan, RejectsWhatDoesNotFit) {
  DenseBwdPlan p;
  EXPECT_FALSE(MakeDenseBwdPlan(16384, 32768, 8192, 2, 2, true, 0, &p).ok());  // m > k for a 2-byte dk
  EXPECT_FALSE(MakeDenseBwdPlan(500, 1024, 256, 4, 2, true, 0, &p).ok());      // m not a multiple of 16
  EXPECT_FALSE(MakeDenseBwdPlan(512, 1008, 256, 4, 2, true, 0, &p).ok());      // no slice width % 128
  EXPECT_FALSE(MakeDenseBwdPlan(512, 1024, 256, 3, 2, true, 0, &p).ok());
}

}  // namespace
}  // namespace lowbit
