// A probe (not part of the library or its tests): are there cuBLASLt configurations of the seed
// Dense's GEMMs faster than the ones cuBLASLt's heuristic returns (all lowbit ever runs,
// LOWBIT_GEMM_ALGO picking among them)? For each GEMM of the step (fwd, dgrad, wgrad; the
// per-tensor FP8 ones and Float8BlockScaling's 1x128 x 128x128 and 1x128 x 1x128 ones) it
//   1. times every result of cublasLtMatmulAlgoGetHeuristic (up to 64, best-fit search);
//   2. asks the heuristic again limited to each algorithm id cublasLtMatmulAlgoGetIds lists;
//   3. builds configurations by hand for each id: every tile and stage id the id's caps list,
//      cluster shapes auto/1x1/2x1/1x2/2x2/4x1/1x4, CTA swizzling 0/1, custom options 0..max,
//      no split-K, each kept if cublasLtMatmulAlgoCheck accepts it within a 32 MiB workspace
//      (all but id 67, whose 280896 configurations per problem none passed on the first run);
// and times them all, each beside the heuristic's first (the card warm, the order shuffled), then
// the best 12 and the heuristic's first three in 7 interleaved rounds, and compares the best
// one's output with the heuristic's. Operands are random finite FP8 codes, scales 1.
//   nvcc -O2 -std=c++17 -arch=sm_90a tools/probe_algo_space.cu -lcublasLt -o /tmp/probe_algo && /tmp/probe_algo [filter]
#include "probe_cublaslt_gemm.h"

#include <cstring>
#include <set>
#include <string>

namespace {

enum Mode { kTensor = 0, kVec128 = 1, kBlk128 = 2 };

// out[m, n] = a[m, k] . b[n, k]^T (lowbit's convention), both operands K-major.
struct Problem {
  const char* name;
  int64_t m, n, k;
  cudaDataType_t ta, tb, td;
  bool fast, bias;
  Mode ma, mb;
};

size_t ScaleFloats(Mode mode, int64_t rows, int64_t k) {
  const int64_t kb = (k + 127) / 128;
  if (mode == kVec128) return size_t(kb) * size_t((rows + 3) / 4 * 4);
  if (mode == kBlk128) return size_t((rows + 127) / 128) * size_t((kb + 3) / 4 * 4);
  return 1;
}

__global__ void FillOnes(float* p, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) p[i] = 1.f;
}

struct Config {
  cublasLtMatmulAlgo_t algo;
  size_t ws;
  std::string label;
  float ms = 0;
};

struct Runner {
  Problem p;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, ld;
  uint8_t *a, *b, *d, *ws;
  float *sa, *sb;
  void* bias = nullptr;
  cudaStream_t s;

  explicit Runner(const Problem& pr, cudaStream_t stream) : p(pr), s(stream) {
    CK(cudaMalloc(&a, p.m * p.k));
    CK(cudaMalloc(&b, p.n * p.k));
    const size_t out_bytes = p.td == CUDA_R_32F ? 4 : 2;
    CK(cudaMalloc(&d, p.m * p.n * out_bytes));
    CK(cudaMalloc(&ws, kWs));
    const size_t fa = ScaleFloats(p.ma, p.m, p.k), fb = ScaleFloats(p.mb, p.n, p.k);
    CK(cudaMalloc(&sa, fa * 4));
    CK(cudaMalloc(&sb, fb * 4));
    FillOnes<<<256, 256>>>(sa, fa);
    FillOnes<<<256, 256>>>(sb, fb);
    Fill<<<1024, 256>>>(a, p.m * p.k, 11);
    Fill<<<1024, 256>>>(b, p.n * p.k, 12);
    if (p.bias) {
      CK(cudaMalloc(&bias, p.n * out_bytes));
      CK(cudaMemset(bias, 0, p.n * out_bytes));
    }
    CK(cudaDeviceSynchronize());
    CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    int32_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof(nn)));
    int8_t f = p.fast;
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &f, sizeof(f)));
    if (p.ma != kTensor) {
      auto mode = [](Mode m) {
        return int32_t(m == kBlk128 ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F);
      };
      int32_t ma = mode(p.mb), mb = mode(p.ma);  // cuBLASLt's A is our b
      CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma, sizeof(ma)));
      CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb, sizeof(mb)));
    }
    const void* pa = sb;
    const void* pb = sa;
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &pa, sizeof(pa)));
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &pb, sizeof(pb)));
    if (p.bias) {
      uint32_t epi = CUBLASLT_EPILOGUE_BIAS;
      int32_t bt = p.td;
      CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
      CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
      CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    }
    CK(cublasLtMatrixLayoutCreate(&la, p.tb, p.k, p.n, p.k));
    CK(cublasLtMatrixLayoutCreate(&lb, p.ta, p.k, p.m, p.k));
    CK(cublasLtMatrixLayoutCreate(&ld, p.td, p.n, p.m, p.n));
  }

  cublasStatus_t Run(const cublasLtMatmulAlgo_t& algo, size_t wsb) {
    float alpha = 1.f, beta = 0.f;
    return cublasLtMatmul(g_lt, desc, &alpha, b, la, a, lb, &beta, d, ld, d, ld, &algo, ws, wsb, s);
  }

  std::vector<cublasLtMatmulHeuristicResult_t> Heuristic(int want, const cublasLtMatmulAlgo_t* limited) {
    cublasLtMatmulPreference_t pref;
    CK(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t lim = kWs;
    CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &lim, sizeof(lim)));
    std::vector<cublasLtMatmulHeuristicResult_t> r(want);
    if (limited) {
      uint32_t mode = CUBLASLT_SEARCH_LIMITED_BY_ALGO_ID;
      CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_SEARCH_MODE, &mode, sizeof(mode)));
      r[0].algo = *limited;
    }
    int found = 0;
    if (cublasLtMatmulAlgoGetHeuristic(g_lt, desc, la, lb, ld, ld, pref, want, r.data(), &found) != CUBLAS_STATUS_SUCCESS)
      found = 0;
    cublasLtMatmulPreferenceDestroy(pref);
    r.resize(found);
    std::vector<cublasLtMatmulHeuristicResult_t> ok;
    for (auto& x : r)
      if (x.state == CUBLAS_STATUS_SUCCESS) ok.push_back(x);
    return ok;
  }
};

template <typename T>
std::vector<T> CapList(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attr) {
  size_t sz = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, nullptr, 0, &sz) != CUBLAS_STATUS_SUCCESS || sz == 0) return {};
  std::vector<T> v(sz / sizeof(T));
  cublasLtMatmulAlgoCapGetAttribute(&algo, attr, v.data(), sz, &sz);
  return v;
}

void Explore(const Problem& p, cudaStream_t s) {
  Runner r(p, s);
  const double flops = 2.0 * p.m * p.n * p.k;
  std::printf("\n== %s: m %ld n %ld k %ld\n", p.name, long(p.m), long(p.n), long(p.k));
  std::vector<Config> all;
  std::set<std::string> seen;
  auto add = [&](const cublasLtMatmulAlgo_t& algo, size_t ws, const char* src) {
    std::string key = Describe(algo);
    if (!seen.insert(key).second) return;
    all.push_back({algo, ws, std::string(src) + " " + key});
  };
  auto heur = r.Heuristic(64, nullptr);
  std::printf("heuristic (best fit): %zu results\n", heur.size());
  for (auto& h : heur) add(h.algo, h.workspaceSize, "heur");
  const size_t n_heur = all.size();

  int ids[256];
  int n_ids = 0;
  CK(cublasLtMatmulAlgoGetIds(g_lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, p.tb, p.ta, p.td, p.td, 256, ids, &n_ids));
  std::printf("algo ids for these types: %d:", n_ids);
  for (int i = 0; i < n_ids; ++i) std::printf(" %d", ids[i]);
  std::printf("\n");
  const uint16_t clusters[] = {CUBLASLT_CLUSTER_SHAPE_AUTO, CUBLASLT_CLUSTER_SHAPE_1x1x1, CUBLASLT_CLUSTER_SHAPE_2x1x1,
                               CUBLASLT_CLUSTER_SHAPE_1x2x1, CUBLASLT_CLUSTER_SHAPE_2x2x1, CUBLASLT_CLUSTER_SHAPE_4x1x1,
                               CUBLASLT_CLUSTER_SHAPE_1x4x1};
  for (int i = 0; i < n_ids; ++i) {
    if (ids[i] == 67) continue;  // 280896 configurations to check, none valid here (H200, 2026-11-29)
    cublasLtMatmulAlgo_t base;
    if (cublasLtMatmulAlgoInit(g_lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, p.tb, p.ta, p.td, p.td, ids[i], &base) !=
        CUBLAS_STATUS_SUCCESS)
      continue;
    auto lim = r.Heuristic(64, &base);
    for (auto& h : lim) add(h.algo, h.workspaceSize, "limited");
    auto tiles = CapList<uint32_t>(base, CUBLASLT_ALGO_CAP_TILE_IDS);
    auto stages = CapList<uint32_t>(base, CUBLASLT_ALGO_CAP_STAGES_IDS);
    int swz_ok = 0, custom_max = 0;
    size_t sz;
    cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT, &swz_ok, sizeof(swz_ok), &sz);
    cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX, &custom_max, sizeof(custom_max), &sz);
    if (tiles.empty()) tiles.push_back(0);
    if (stages.empty()) stages.push_back(0);
    int checked = 0, valid = 0;
    for (uint32_t tile : tiles)
      for (uint32_t st : stages)
        for (uint16_t cl : clusters)
          for (int swz = 0; swz <= (swz_ok ? 1 : 0); ++swz)
            for (int cu = 0; cu <= std::min(custom_max, 7); ++cu) {
              cublasLtMatmulAlgo_t a = base;
              int one = 1;
              cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile));
              cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &st, sizeof(st));
              cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cl, sizeof(cl));
              cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swz, sizeof(swz));
              cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &cu, sizeof(cu));
              cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof(one));
              cublasLtMatmulHeuristicResult_t res{};
              ++checked;
              if (cublasLtMatmulAlgoCheck(g_lt, r.desc, r.la, r.lb, r.ld, r.ld, &a, &res) != CUBLAS_STATUS_SUCCESS)
                continue;
              if (res.workspaceSize > kWs) continue;
              ++valid;
              add(a, res.workspaceSize, "manual");
            }
    std::printf("id %d: %zu tiles, %zu stages, swizzle %d, custom max %d, %zu limited-heuristic results; %d configs checked, %d valid\n",
                ids[i], tiles.size(), stages.size(), swz_ok, custom_max, lim.size(), checked, valid);
  }
  // Fair timing: the card warm, candidates in a shuffled order, each timed against the heuristic's
  // first (the reference), re-timed every 16 candidates so that drift of the card's clocks
  // cancels; then the best 12 (and the heuristic's first three) in 7 interleaved rounds.
  const Config ref = all[0];
  auto time1 = [&](const Config& c) {
    if (r.Run(c.algo, c.ws) != CUBLAS_STATUS_SUCCESS || cudaStreamSynchronize(s) != cudaSuccess) return -1.f;
    return TimeMs([&] { r.Run(c.algo, c.ws); }, 1, s);
  };
  for (int i = 0; i < 250; ++i) r.Run(ref.algo, ref.ws);  // ~1.5 s at the seed shapes
  CK(cudaStreamSynchronize(s));
  std::vector<size_t> order(all.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  uint64_t rng = 12345;
  for (size_t i = order.size(); i > 1; --i) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    std::swap(order[i - 1], order[(rng >> 33) % i]);
  }
  float ref_ms = time1(ref);
  std::vector<float> ratio(all.size(), -1);
  for (size_t j = 0; j < order.size(); ++j) {
    if (j % 16 == 15) ref_ms = time1(ref);
    const float t = time1(all[order[j]]);
    all[order[j]].ms = t;
    if (t > 0) ratio[order[j]] = ref_ms / t;
  }
  std::vector<size_t> ok;
  for (size_t i = 0; i < all.size(); ++i)
    if (ratio[i] > 0) ok.push_back(i);
  std::sort(ok.begin(), ok.end(), [&](size_t x, size_t y) { return ratio[x] > ratio[y]; });
  std::printf("%zu of %zu ran; best against the reference timed beside it (x > 1: faster):\n", ok.size(), all.size());
  for (size_t i = 0; i < ok.size() && i < 10; ++i)
    std::printf("  x%.3f %8.3f ms  %s\n", ratio[ok[i]], all[ok[i]].ms, all[ok[i]].label.c_str());
  std::vector<size_t> again;
  for (size_t i = 0; i < n_heur && i < 3; ++i) again.push_back(i);
  for (size_t i = 0; i < ok.size() && again.size() < 15; ++i)
    if (std::find(again.begin(), again.end(), ok[i]) == again.end()) again.push_back(ok[i]);
  std::vector<std::vector<float>> t(again.size());
  for (int round = 0; round < 7; ++round)
    for (size_t i = 0; i < again.size(); ++i) t[i].push_back(TimeMs([&] { r.Run(all[again[i]].algo, all[again[i]].ws); }, 3, s));
  std::vector<float> med(again.size());
  for (size_t i = 0; i < again.size(); ++i) {
    std::sort(t[i].begin(), t[i].end());
    med[i] = t[i][3];
  }
  std::printf("re-timed, 7 interleaved rounds of 3 calls (x: the heuristic's first median / this median):\n");
  for (size_t i = 0; i < again.size(); ++i)
    std::printf("  x%.3f median %8.3f ms %6.0f TFLOP/s (min %.3f max %.3f)  %s\n", med[0] / med[i], med[i],
                flops / med[i] / 1e9, t[i][0], t[i][6], all[again[i]].label.c_str());
  // The best re-timed configuration's output against the reference's.
  size_t best = 0;
  for (size_t i = 1; i < again.size(); ++i)
    if (med[i] < med[best]) best = i;
  if (best != 0) {
    const size_t out_bytes = p.td == CUDA_R_32F ? 4 : 2, n_out = size_t(p.m) * size_t(p.n);
    std::vector<uint8_t> h0(n_out * out_bytes), h1(n_out * out_bytes);
    r.Run(ref.algo, ref.ws);
    CK(cudaMemcpyAsync(h0.data(), r.d, h0.size(), cudaMemcpyDeviceToHost, s));
    r.Run(all[again[best]].algo, all[again[best]].ws);
    CK(cudaMemcpyAsync(h1.data(), r.d, h1.size(), cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    auto val = [&](const std::vector<uint8_t>& h, size_t i) {
      if (out_bytes == 4) { float f; std::memcpy(&f, &h[4 * i], 4); return double(f); }
      uint32_t u = uint32_t(h[2 * i]) << 16 | uint32_t(h[2 * i + 1]) << 24;
      float f; std::memcpy(&f, &u, 4); return double(f);
    };
    double maxdiff = 0, maxabs = 0;
    size_t differ = 0;
    for (size_t i = 0; i < n_out; ++i) {
      const double a0 = val(h0, i), a1 = val(h1, i);
      maxabs = std::max(maxabs, std::abs(a0));
      if (a0 != a1) ++differ;
      maxdiff = std::max(maxdiff, std::abs(a0 - a1));
    }
    std::printf("best re-timed vs reference output: %zu of %zu values differ, max |diff| %.4g of max |ref| %.4g\n", differ,
                n_out, maxdiff, maxabs);
  }
  CK(cudaFree(r.a));
  CK(cudaFree(r.b));
  CK(cudaFree(r.d));
  CK(cudaFree(r.ws));
  CK(cudaFree(r.sa));
  CK(cudaFree(r.sb));
  if (r.bias) CK(cudaFree(r.bias));
}

}  // namespace

int main(int argc, char** argv) {
  CK(cublasLtCreate(&g_lt));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int64_t M = 16384, K = 8192, N = 32768;  // seed Dense: tokens, hidden, features
  const auto e4 = CUDA_R_8F_E4M3, e5 = CUDA_R_8F_E5M2, bf = CUDA_R_16BF, f32 = CUDA_R_32F;
  const Problem problems[] = {
      {"tensor fwd (fast, bias)", M, N, K, e4, e4, bf, true, true, kTensor, kTensor},
      {"tensor dgrad (split)", M, K, N, e5, e4, bf, false, false, kTensor, kTensor},
      {"tensor wgrad (split, f32)", K, N, M, e4, e5, f32, false, false, kTensor, kTensor},
      // One slice of the fused backward's wgrad (dense_backward.h, S = 8: 4096 columns of dk).
      {"tensor wgrad slice (split, f32)", K, N / 8, M, e4, e5, f32, false, false, kTensor, kTensor},
      // Float8BlockScaling: E4M3 throughout, split accumulation in all three (lowbit/recipe.py).
      {"block fwd 1x128 x 128x128 (bias)", M, N, K, e4, e4, bf, false, true, kVec128, kBlk128},
      {"block dgrad 1x128 x 128x128", M, K, N, e4, e4, bf, false, false, kVec128, kBlk128},
      {"block wgrad 1x128 x 1x128 (f32)", K, N, M, e4, e4, f32, false, false, kVec128, kVec128},
  };
  for (const auto& p : problems) {
    if (argc > 1 && !std::strstr(p.name, argv[1])) continue;
    Explore(p, s);
  }
  return 0;
}
