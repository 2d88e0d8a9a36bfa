// A probe (not part of the library or its tests; bench/results/wgrad_two_streams_probe_*.log): does running the fused Dense
// backward's wgrad singles as row halves on two streams recover their partial last waves?
// Times, on the seed Dense shapes (m 16384 tokens, n 32768, k 8192, S = 8, w = 4096, dy's
// colwise slices placed in dk's buffer as dense_backward.h's plan puts them), the op's GEMMs
// with cuBLASLt directly:
//   seq: dgrad; wgrad slices 0..3 as one batched GEMM; singles 4..7 in order (lowbit today);
//   two: dgrad; batched; then upper halves (dk rows [w, 2w)) of singles 4..7 on a second stream
//        after the batched launch, lower halves on the first stream in order, lower j + 1 after
//        upper j (lower j + 1 overwrites the slot that single j reads);
// and prints the algorithms cuBLASLt picks (and their workspace) for each shape at a 32 MiB and
// a zero workspace limit.
//   nvcc -O2 -std=c++17 -arch=sm_90a tools/probe_wgrad_streams.cu -lcublasLt -o /tmp/probe && /tmp/probe
#include "probe_cublaslt_gemm.h"

int main() {
  SeedBackward sb;
  const int64_t m = sb.m, n = sb.n, k = sb.k, S = sb.S, w = sb.w, pitch = sb.pitch;
  const cudaDataType_t e4 = sb.e4, e5 = sb.e5;
  uint8_t *dyrow = sb.dyrow, *krow = sb.krow, *xcol = sb.xcol, *dk = sb.dk, *dx = sb.dx, *ws0 = sb.ws0, *ws1 = sb.ws1;
  // The halves, built once (their algorithms chosen and printed); the zero-limit twins serve the
  // second stream's launches in the third timed variant.
  Gemm half = sb.Make({w, w, m, m, pitch, n, e4, e5, CUDA_R_32F, false}, "wgrad half");
  Gemm half7 = sb.Make({w, w, m, m, m, n, e4, e5, CUDA_R_32F, false}, "wgrad half 7 (scratch)");
  Gemm half0 = sb.Make(half, "wgrad half, no workspace", 0);
  Gemm half70 = sb.Make(half7, "wgrad half 7, no workspace", 0);
  sb.Make({k, n, m, m, m, n, e4, e5, CUDA_R_32F, false}, "wgrad unsliced");  // its algorithm only

  auto slice = [&](int j) { return sb.Slice(j); };
  cudaStream_t s0, s1;
  CK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  cudaEvent_t eb, eu[S];
  CK(cudaEventCreateWithFlags(&eb, cudaEventDisableTiming));
  for (auto& e : eu) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));

  auto seq = [&]() { sb.RunToday(s0); };
  auto two = [&](bool no_ws) {
    sb.dgrad.Run(dyrow, krow, dx, ws0, s0);
    sb.batched.Run(xcol, slice(0), dk, ws0, s0);
    CK(cudaEventRecord(eb, s0));
    CK(cudaStreamWaitEvent(s1, eb, 0));
    for (int j = S / 2; j < S; ++j) {  // upper halves: a rows [w, 2w), out rows [w, 2w)
      Gemm& g = j == S - 1 ? (no_ws ? half70 : half7) : (no_ws ? half0 : half);
      g.Run(xcol + w * m, slice(j), dk + w * pitch + j * w * 4, no_ws ? nullptr : ws1, s1);
      CK(cudaEventRecord(eu[j], s1));
    }
    for (int j = S / 2; j < S; ++j) {  // lower halves after the previous single's upper half
      if (j > S / 2) CK(cudaStreamWaitEvent(s0, eu[j - 1], 0));
      (j == S - 1 ? half7 : half).Run(xcol, slice(j), dk + j * w * 4, ws0, s0);
    }
    CK(cudaStreamWaitEvent(s0, eu[S - 1], 0));
  };
  auto time = [&](auto&& f, int iters) { return TimeMs(f, iters, s0); };
  for (int i = 0; i < 3; ++i) { seq(); two(false); two(true); }
  CK(cudaDeviceSynchronize());
  // Rounds of 10 steps each, the order rotating per round; medians and per-round ratios.
  const int rounds = 24;
  std::vector<float> ts[3], r1, r2;
  for (int r = 0; r < rounds; ++r) {
    float t[3];
    for (int i = 0; i < 3; ++i) {
      const int v = (r + i) % 3;
      t[v] = v == 0 ? time(seq, 10) : time([&] { two(v == 2); }, 10);
    }
    for (int v = 0; v < 3; ++v) ts[v].push_back(t[v]);
    r1.push_back(t[0] / t[1]);
    r2.push_back(t[0] / t[2]);
  }
  auto med = [](std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  std::printf("%d rounds of 10 steps (dgrad + wgrad), medians: seq %.3f ms, two-stream %.3f ms, two-stream with "
              "the side GEMMs at zero workspace %.3f ms; median per-round speedup over seq %.4fx and %.4fx "
              "(min %.4f max %.4f; min %.4f max %.4f)\n",
              rounds, med(ts[0]), med(ts[1]), med(ts[2]), med(r1), med(r2),
              *std::min_element(r1.begin(), r1.end()), *std::max_element(r1.begin(), r1.end()),
              *std::min_element(r2.begin(), r2.end()), *std::max_element(r2.begin(), r2.end()));
  return 0;
}
