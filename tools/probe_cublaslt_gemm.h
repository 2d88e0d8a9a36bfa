// The cuBLASLt pieces the probes share (tools/probe_wgrad_streams.cu, tools/probe_wgrad_bands.cu,
// tools/probe_algo_space.cu; not part of the library or its tests): a CUDA-call check, an
// algorithm's configuration in one line (Describe; before 2026-11-29 the cluster id, a uint16,
// was read into an int and always printed 0), one FP8 GEMM in lowbit's convention with its
// algorithm chosen and printed, a fill of random finite FP8
// codes, the seed Dense backward's operands as today's fused op places them with its GEMMs in
// today's order (SeedBackward), and an event timer. Header-only: each probe is one nvcc command.
#pragma once

#include <cublasLt.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
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

// An algorithm's configuration in one line (each attribute read at its documented width).
inline std::string Describe(const cublasLtMatmulAlgo_t& algo) {
  int id = 0, splitk = 0, swz = 0, custom = 0;
  uint16_t cluster = 0, inner = 0;
  uint32_t tile32 = 0, stages32 = 0;
  size_t sz;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &sz);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile32, sizeof(tile32), &sz);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages32, sizeof(stages32), &sz);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &sz);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swz, sizeof(swz), &sz);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof(custom), &sz);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster), &sz);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, &inner, sizeof(inner), &sz);
  char buf[160];
  std::snprintf(buf, sizeof(buf), "id %3d tile %3u stages %3u inner %2u cluster %2u swz %d custom %2d splitk %d", id,
                tile32, stages32, unsigned(inner), unsigned(cluster), swz, custom, splitk);
  return buf;
}

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
    std::printf("%-28s m %6ld n %6ld k %6ld batch %d ws_limit %8zu: %s ws %zu (of %d)\n", name, long(m), long(n),
                long(k), batch, ws_limit, Describe(algo).c_str(), ws, found);
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

// The seed Dense backward's operands (m 16384 tokens, n 32768, k 8192) as today's fused op
// places them (dense_backward.h's plan with S = 8: dy's colwise slices in dk's hosts, the last
// in the scratch), filled with random codes, and the op's GEMMs in today's order.
struct SeedBackward {
  static constexpr int64_t m = 16384, n = 32768, k = 8192, S = 8, w = n / S, pitch = n * 4;
  uint8_t *dyrow, *krow, *xcol, *dk, *scr, *dx, *ws0, *ws1;
  float* one;
  Gemm dgrad, batched, single, single7;

  SeedBackward() {
    CK(cublasLtCreate(&g_lt));
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
    dgrad = Make({m, k, n, n, n, k, e5, e4, CUDA_R_16BF, false}, "dgrad");
    batched = Make({k, w, m, m, pitch, n, e4, e5, CUDA_R_32F, false, 4, 0, w * 4, w}, "wgrad batched 0..3");
    single = Make({k, w, m, m, pitch, n, e4, e5, CUDA_R_32F, false}, "wgrad single");
    single7 = Make({k, w, m, m, m, n, e4, e5, CUDA_R_32F, false}, "wgrad single 7 (scratch)");
  }
  static constexpr cudaDataType_t e4 = CUDA_R_8F_E4M3, e5 = CUDA_R_8F_E5M2;
  // A GEMM built once (its algorithm chosen and printed).
  Gemm Make(Gemm g, const char* name, size_t ws_limit = kWs) const {
    g.one = one;
    g.ws_limit = ws_limit;
    g.Build(name);
    return g;
  }
  // Colwise slice j's first row in today's plan.
  const uint8_t* Slice(int j) const {
    if (j == S - 1) return scr;
    const int64_t host = j < S / 2 ? S / 2 + j : j + 1, slot = j < S / 2 ? 1 : 0;
    return dk + host * w * 4 + slot * w * pitch;
  }
  // Today's order: the dgrad, slices 0 .. 3 as one batched GEMM, singles 4 .. 7.
  void RunToday(cudaStream_t s) {
    dgrad.Run(dyrow, krow, dx, ws0, s);
    batched.Run(xcol, Slice(0), dk, ws0, s);
    for (int j = S / 2; j < S; ++j) (j == S - 1 ? single7 : single).Run(xcol, Slice(j), dk + j * w * 4, ws0, s);
  }
};

// Mean ms of `iters` calls of f, timed by events on stream s.
template <typename F>
float TimeMs(F&& f, int iters, cudaStream_t s) {
  cudaEvent_t t0, t1;
  CK(cudaEventCreate(&t0));
  CK(cudaEventCreate(&t1));
  CK(cudaEventRecord(t0, s));
  for (int i = 0; i < iters; ++i) f();
  CK(cudaEventRecord(t1, s));
  CK(cudaEventSynchronize(t1));
  float ms;
  CK(cudaEventElapsedTime(&ms, t0, t1));
  CK(cudaEventDestroy(t0));
  CK(cudaEventDestroy(t1));
  return ms / iters;
}
