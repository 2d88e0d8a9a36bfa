// A probe (not part of the library or its tests; bench/results/wgrad_bands_probe_*.log): would
// the fused Dense backward run its wgrad in two launches instead of five if it could write
// into the kernel's FP8 copy (k_row) once the dgrad has read it? Times, on the seed Dense shapes
// (m 16384 tokens, n 32768, k 8192), with cuBLASLt directly:
//   seq:      dgrad; wgrad slices 0..3 as one batched GEMM; singles 4..7 in order (lowbit
//             today, dense_backward.h's plan with S = 8: dy's colwise slices in dk's hosts);
//   bands:    dy's colwise copy in dk's right half as four bands of 8192 rows at dk's pitch;
//             dgrad; then the wgrad of dk's left half (bands 0, 1) as one batched GEMM while a
//             second stream copies bands 2, 3 into k_row (free after the dgrad); then the right
//             half (n 16384) as one GEMM from k_row;
//   serial:   bands with the copy on the first stream, before the wgrad (the copy's own cost);
//   unsliced: dgrad; one wgrad GEMM from a colwise copy of its own (the unfused ops' floor).
// 101 waves of 128x160 tiles for bands' and unsliced's wgrad against 103 for seq's.
//   nvcc -O2 -std=c++17 -arch=sm_90a tools/probe_wgrad_bands.cu -lcublasLt -o /tmp/probe_bands && /tmp/probe_bands
#include <algorithm>
#include <vector>

#include "probe_cublaslt_gemm.h"

int main() {
  SeedBackward sb;
  const int64_t m = sb.m, n = sb.n, k = sb.k, pitch = sb.pitch;
  const int64_t band = k, half = n * 2, band_bytes = m;  // band b: colwise rows [b k, (b+1) k); dk's right half
  const cudaDataType_t e4 = sb.e4, e5 = sb.e5;
  uint8_t *dyrow = sb.dyrow, *krow = sb.krow, *xcol = sb.xcol, *dk = sb.dk, *dx = sb.dx, *ws0 = sb.ws0, *colwise;
  CK(cudaMalloc(&colwise, n * m));
  Fill<<<1024, 256>>>(colwise, n * m, 6);
  CK(cudaDeviceSynchronize());
  Gemm left = sb.Make({k, band, m, m, pitch, n, e4, e5, CUDA_R_32F, false, 2, 0, band_bytes, band},
                      "bands: left half (2 bands)");
  Gemm right = sb.Make({k, n / 2, m, m, m, n, e4, e5, CUDA_R_32F, false}, "bands: right half from k_row");
  Gemm unsliced = sb.Make({k, n, m, m, m, n, e4, e5, CUDA_R_32F, false}, "wgrad unsliced");

  cudaStream_t s0, s1;
  CK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  cudaEvent_t ed, ec;
  CK(cudaEventCreateWithFlags(&ed, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&ec, cudaEventDisableTiming));

  auto seq = [&]() { sb.RunToday(s0); };
  // Bands 2 and 3 (dk bytes [half + 2 m, half + 4 m) of every row) into k_row, in colwise row order.
  auto copy = [&](cudaStream_t s) {
    for (int b = 2; b < 4; ++b) {
      CK(cudaMemcpy2DAsync(krow + (b - 2) * band * m, m, dk + half + b * band_bytes, pitch, m, band,
                           cudaMemcpyDeviceToDevice, s));
    }
  };
  auto bands = [&](bool overlap) {
    sb.dgrad.Run(dyrow, krow, dx, ws0, s0);
    if (overlap) {
      CK(cudaEventRecord(ed, s0));
      CK(cudaStreamWaitEvent(s1, ed, 0));
      copy(s1);
      CK(cudaEventRecord(ec, s1));
    } else {
      copy(s0);
    }
    left.Run(xcol, dk + half, dk, ws0, s0);
    if (overlap) CK(cudaStreamWaitEvent(s0, ec, 0));
    right.Run(xcol, krow, dk + (n / 2) * 4, ws0, s0);
  };
  auto floor = [&]() {
    sb.dgrad.Run(dyrow, krow, dx, ws0, s0);
    unsliced.Run(xcol, colwise, dk, ws0, s0);
  };
  auto time = [&](auto&& f, int iters) { return TimeMs(f, iters, s0); };
  auto run = [&](int v) {
    if (v == 0) seq();
    else if (v == 1) bands(true);
    else if (v == 2) bands(false);
    else floor();
  };
  for (int i = 0; i < 3; ++i) for (int v = 0; v < 4; ++v) run(v);
  CK(cudaDeviceSynchronize());
  // Rounds of 10 steps each, the order rotating per round; medians and per-round ratios to seq.
  const int rounds = 24, kV = 4;
  const char* names[kV] = {"seq", "bands", "serial", "unsliced"};
  std::vector<float> ts[kV], ratio[kV];
  for (int r = 0; r < rounds; ++r) {
    float t[kV];
    for (int i = 0; i < kV; ++i) {
      const int v = (r + i) % kV;
      t[v] = time([&] { run(v); }, 10);
    }
    for (int v = 0; v < kV; ++v) {
      ts[v].push_back(t[v]);
      ratio[v].push_back(t[0] / t[v]);
    }
  }
  auto med = [](std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  std::printf("%d rounds of 10 steps (dgrad + wgrad), the order rotating:\n", rounds);
  for (int v = 0; v < kV; ++v) {
    std::printf("  %-9s median %.3f ms, median per-round speedup over seq %.4fx (min %.4f max %.4f)\n", names[v],
                med(ts[v]), med(ratio[v]), *std::min_element(ratio[v].begin(), ratio[v].end()),
                *std::max_element(ratio[v].begin(), ratio[v].end()));
  }
  return 0;
}
