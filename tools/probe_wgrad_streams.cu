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
#include <cublasLt.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                                  \
  do {                                                                                         \
    auto s_ = (x);                                                                             \
    if (int(s_) != 0) {                                                                        \
      std::fprintf(stderr, "%s:%d %s -> %d\n", __FILE__, __LINE__, #x, int(s_));               \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

static cublasLtHandle_t g_lt;
static const size_t kWs = size_t(32) << 20;

// One GEMM in lowbit's convention: out[m, n] (row pitch ldd) = a[m, k] . b[n, k]^T, a and b
// row-major FP8 with row pitches lda, ldb; `batch` entries strided.
struct Gemm {
  int64_t m, n, k, lda, ldb, ldd;
  cudaDataType_t ta, tb, td;
  bool fast;
  int batch = 1;
  int64_t sa = 0, sb = 0, sd = 0;
  size_t ws_limit = kWs;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, ld;
  cublasLtMatmulAlgo_t algo;
  size_t ws;
  const float* one;

  void Build(const char* name) {
    CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    int32_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof(nn)));
    int8_t f = fast;
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &f, sizeof(f)));
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &one, sizeof(one)));
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &one, sizeof(one)));
    auto layout = [&](cublasLtMatrixLayout_t* l, cudaDataType_t ty, int64_t r, int64_t c, int64_t ldx, int64_t stride) {
      CK(cublasLtMatrixLayoutCreate(l, ty, r, c, ldx));
      if (batch > 1) {
        CK(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch)));
        CK(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
      }
    };
    layout(&la, tb, k, n, ldb, sb);  // cuBLASLt's A is our b
    layout(&lb, ta, k, m, lda, sa);
    layout(&ld, td, n, m, ldd, sd);
    cublasLtMatmulPreference_t pref;
    CK(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t lim = ws_limit;
    CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &lim, sizeof(lim)));
    cublasLtMatmulHeuristicResult_t r[4];
    int found = 0;
    CK(cublasLtMatmulAlgoGetHeuristic(g_lt, desc, la, lb, ld, ld, pref, 4, r, &found));
    if (found == 0) {
      std::fprintf(stderr, "%s: no algorithm\n", name);
      std::exit(1);
    }
    algo = r[0].algo;
    ws = r[0].workspaceSize;
    int id = 0, tile = 0, stages = 0, splitk = 0, cluster = 0;
    size_t sz;
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &sz);
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &sz);
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &sz);
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &sz);
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster), &sz);
    std::printf("%-28s m %6ld n %6ld k %6ld batch %d ws_limit %8zu: algo %d tile %d stages %d splitk %d cluster %d ws %zu (of %d)\n",
                name, long(m), long(n), long(k), batch, ws_limit, id, tile, stages, splitk, cluster, ws, found);
  }
  void Run(const void* a, const void* b, void* d, void* wsp, cudaStream_t s) {
    float alpha = 1.f, beta = 0.f;
    CK(cublasLtMatmul(g_lt, desc, &alpha, b, la, a, lb, &beta, d, ld, d, ld, &algo, wsp, ws, s));
  }
};

__global__ void Fill(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    p[i] = uint8_t(h & 0x77);  // bits 7 and 3 cleared: positive codes <= 0x77, finite in E4M3 and E5M2
  }
}

int main() {
  const int64_t m = 16384, n = 32768, k = 8192, S = 8, w = n / S, pitch = n * 4;
  CK(cublasLtCreate(&g_lt));
  uint8_t *dyrow, *krow, *xcol, *dk, *scr, *dx, *ws0, *ws1;
  float* one;
  CK(cudaMalloc(&dyrow, m * n));
  CK(cudaMalloc(&krow, k * n));
  CK(cudaMalloc(&xcol, k * m));
  CK(cudaMalloc(&dk, k * n * 4));
  CK(cudaMalloc(&scr, w * m));
  CK(cudaMalloc(&dx, m * k * 2));
  CK(cudaMalloc(&ws0, kWs));
  CK(cudaMalloc(&ws1, kWs));
  CK(cudaMalloc(&one, 4));
  float h1 = 1.f;
  CK(cudaMemcpy(one, &h1, 4, cudaMemcpyHostToDevice));
  Fill<<<1024, 256>>>(dyrow, m * n, 1);
  Fill<<<1024, 256>>>(krow, k * n, 2);
  Fill<<<1024, 256>>>(xcol, k * m, 3);
  Fill<<<1024, 256>>>(dk, k * n * 4, 4);
  Fill<<<1024, 256>>>(scr, w * m, 5);
  CK(cudaDeviceSynchronize());

  const cudaDataType_t e4 = CUDA_R_8F_E4M3, e5 = CUDA_R_8F_E5M2;
  // Each GEMM built once (its algorithm chosen and printed); the zero-limit twins of the halves
  // serve the second stream's launches in the third timed variant.
  auto make = [&](Gemm g, const char* name, size_t ws_limit = kWs) {
    g.one = one;
    g.ws_limit = ws_limit;
    g.Build(name);
    return g;
  };
  Gemm dgrad = make({m, k, n, n, n, k, e5, e4, CUDA_R_16BF, false}, "dgrad");
  Gemm batched = make({k, w, m, m, pitch, n, e4, e5, CUDA_R_32F, false, 4, 0, w * 4, w}, "wgrad batched 0..3");
  Gemm single = make({k, w, m, m, pitch, n, e4, e5, CUDA_R_32F, false}, "wgrad single");
  Gemm single7 = make({k, w, m, m, m, n, e4, e5, CUDA_R_32F, false}, "wgrad single 7 (scratch)");
  Gemm half = make({w, w, m, m, pitch, n, e4, e5, CUDA_R_32F, false}, "wgrad half");
  Gemm half7 = make({w, w, m, m, m, n, e4, e5, CUDA_R_32F, false}, "wgrad half 7 (scratch)");
  Gemm half0 = make(half, "wgrad half, no workspace", 0);
  Gemm half70 = make(half7, "wgrad half 7, no workspace", 0);
  make({k, n, m, m, m, n, e4, e5, CUDA_R_32F, false}, "wgrad unsliced");  // its algorithm only

  auto slice = [&](int j) -> const uint8_t* {
    if (j == S - 1) return scr;
    const int64_t host = j < S / 2 ? S / 2 + j : j + 1, slot = j < S / 2 ? 1 : 0;
    return dk + host * w * 4 + slot * w * pitch;
  };
  cudaStream_t s0, s1;
  CK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  cudaEvent_t eb, eu[S], t0, t1;
  CK(cudaEventCreateWithFlags(&eb, cudaEventDisableTiming));
  for (auto& e : eu) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  CK(cudaEventCreate(&t0));
  CK(cudaEventCreate(&t1));

  auto seq = [&]() {
    dgrad.Run(dyrow, krow, dx, ws0, s0);
    batched.Run(xcol, slice(0), dk, ws0, s0);
    for (int j = S / 2; j < S; ++j) (j == S - 1 ? single7 : single).Run(xcol, slice(j), dk + j * w * 4, ws0, s0);
  };
  auto two = [&](bool no_ws) {
    dgrad.Run(dyrow, krow, dx, ws0, s0);
    batched.Run(xcol, slice(0), dk, ws0, s0);
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
  auto time = [&](auto&& f, int iters) {
    CK(cudaEventRecord(t0, s0));
    for (int i = 0; i < iters; ++i) f();
    CK(cudaEventRecord(t1, s0));
    CK(cudaEventSynchronize(t1));
    float ms;
    CK(cudaEventElapsedTime(&ms, t0, t1));
    return ms / iters;
  };
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
