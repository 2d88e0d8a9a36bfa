// Host-only launch planning of the normalization kernels that does not need a device:
// the row geometry (shared by norm_fwd.cu and norm_bwd.cu), the forward's launch tuning
// (NormFwdTuning, LOWBIT_NORM_FWD_VARIANT) and the backward pass's workspace size, a
// function of the shape alone.
//
// The workspace size is duplicated in Python (lowbit/ops/norm.py:
// norm_backward_workspace_bytes): JAX allocates it as an extra result of the
// lowbit_norm_backward custom call (XLA's FFI scratch allocator is not usable there), so it
// must be known at lowering time without a device. Change both together; the CPU handler
// checks that the Python size equals NormBackwardWorkspaceBytes on every call, so the CPU
// test suite catches a drift, and the CUDA launcher checks that its plan fits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/dtype.h"

namespace lowbit {

constexpr int64_t kNormMaxHidden = 16384;

// Backward stage 1: blocks of at most this many threads (several row groups per block when
// rows are short) and at most this many blocks (the launcher uses min(row tiles, resident
// blocks, this)). Each block writes one partial row of dgamma and of dbeta: its row groups
// are summed in shared memory first, so the partials are per block, not per row group.
constexpr int kNormBwdBlockThreads = 1024;
constexpr int64_t kNormBwdMaxBlocks = 512;

// Launch geometry for one row of `hidden` elements of `elem_bytes` each.
struct RowGeometry {
  int items = 0;            // elements per thread: 4, 8 or 16
  bool vectorized = false;  // 16-byte chunks (kVec = 16 / elem_bytes) or scalars
  int threads_per_row = 0;  // multiple of 32, <= 1024
};

// Geometry of the forward and the backward: the fewest items per thread that keep a row at
// <= 1024 threads (8 items, one 16-byte chunk of bf16/f16, up to hidden 8192; 16 beyond).
// Fewer items per thread leave registers for the next row's loads. `min_items` (forward
// tuning, vectorized rows only) asks for at least that many items per thread where the row
// then still spans >= 128 threads.
inline RowGeometry ChooseRowGeometry(int64_t hidden, int elem_bytes, bool pointers_aligned,
                                     int min_items = 4) {
  RowGeometry g;
  const int vec = 16 / elem_bytes;
  g.vectorized = pointers_aligned && hidden % vec == 0;
  const int v = g.vectorized ? vec : 1;
  const int64_t chunks = (hidden + v - 1) / v;
  auto threads_for = [&](int items) {
    const int64_t per_thread = items / v;
    return ((chunks + per_thread - 1) / per_thread + 31) / 32 * 32;
  };
  for (int items : {4, 8, 16}) {
    if (items < v) continue;
    g.items = items;
    g.threads_per_row = int(threads_for(items));
    if (g.threads_per_row <= 1024) break;
  }
  if (g.vectorized) {
    for (int items : {8, 16}) {
      if (items > g.items && items <= min_items && threads_for(items) >= 128) {
        g.items = items;
        g.threads_per_row = int(threads_for(items));
      }
    }
  }
  return g;
}

// Launch tuning of the forward pass (norm_fwd.cu). The defaults are the measured best (H100,
// 16384 x 4096/8192 bf16, bench/results/norm_variants_*: stages=2 beat 3 and 4; colwise
// colspan=32 with interleaved cluster tiles and the split barrier, 174.5 / 349.7 us, beat
// colspan=64 (192.5 / 380.2) and 128 (216.7 / 422.9), and l1keep=0 beat 1 at 8192, 349.7 vs
// 371.3 us; then colblock=1024 with colbar=1, 168.6 / 336.3 us, beat colblock=512 with
// colbar=0, 176.1 / 355.6, while parsmem=1 was slower in every combination tried); the
// environment variable LOWBIT_NORM_FWD_VARIANT ("items=16,stages=2,block=512,colblock=1024,
// coltile=0,colspan=32,colorder=1,colsplit=1,l1keep=0,parsmem=0,colbar=1,parkeep=1,parstages=3",
// any subset) overrides them, as a benchmark knob
// (bench/bench_norm.py --variants): every setting computes the same results up to the order
// of the row sums. "colspan=32,colorder=0,colsplit=0,l1keep=0" is the colwise path before colspan.
//   items:    fewest elements per thread on the vectorized path (8 or 16; see above)
//   stages:   rows per row group in flight, staged in shared memory by cp.async (1..4;
//             lowered by the launcher while the shared memory does not fit)
//   block:    target threads per block without colwise (32..1024)
//   colblock: target threads per block with colwise (32..1024)
//   coltile:  colwise: rows of FP8 codes one block stages (4, 8, 16 or 32; 0 = the largest
//             up to colspan that lets two blocks share an SM).
//   colspan:  colwise: rows per transposed column segment (32, 64 or 128 bytes per column
//             store): a cluster of colspan / coltile blocks (sm_90+, at most 16) reads each
//             other's codes. Where the cluster does not fit the GPU the launcher halves it.
//             16-row segments (half-sector column stores, whose halves L2 does not merge in
//             time) measured 2x slower at 4096 and 8192, 288 / 640 us, even with neighbouring
//             blocks writing the two halves in the same round (bench/results/
//             norm_variants_parkeep_*); that knob (colspan=16, and 0: 32 or 16 by fit) is gone.
//   colorder: colwise: cluster tiles per cluster contiguous (0) or interleaved over the
//             clusters (1: the clusters write neighbouring column segments at the same time,
//             so a 128-byte line of q_colwise is completed in L2 before it is evicted).
//   colsplit: colwise: after the transposed stores, the barrier that keeps a block from
//             rewriting its staged codes while peers read them is split (1: arrive at once,
//             wait only before the next tile's first codes are staged) or whole (0).
//   l1keep:   colwise: the automatic block tile leaves L1 room for gamma (and beta), read
//             per row, and the shared memory carveout is the smallest that holds the
//             resident blocks (1), or the tile ignores L1 and the carveout is the driver's (0).
//   parsmem:  vectorized rows of > 8 items per thread or colwise: gamma (NormWeight
//             applied) and beta staged once per block as fp32 in shared memory after the
//             row stages and the codes tile (1), counted in the tile choice, instead of
//             reloaded per row through L1 (0; colwise, at the tiles above L1 keeps 28 KB,
//             less than the 32 / 64 KB of f32 gamma + beta at 4096 / 8192, and every cluster
//             wait invalidates it, so rows re-read them from L2). Blocks of > 512 threads (colblock=1024) cannot share
//             an SM (64 registers per thread): their automatic tile is the largest that fits.
//   colbar:   colwise clusters: the cluster barriers order the full memory (0: release on
//             arrive, which on sm_90 also waits for every global store in flight) or shared
//             memory only (1: fences restricted to shared memory, relaxed arrive).
//   parkeep:  colwise, vectorized rows of <= 512 threads: gamma (NormWeight applied) and
//             beta held as fp32 in registers, loaded once per block before the row loop (a
//             thread's columns are the same in every row), instead of per row (1; 0: per
//             row through L1, which at 8192 holds 28 KB of the 64 KB of f32 gamma + beta, so
//             rows re-read them from L2). That kernel is bounded to 512 threads (the 32
//             registers of 16 items do not fit the 64 of a 1024-thread block): blocks take
//             min(colblock, 512) threads, one block per SM (its tile is the largest that
//             fits, as colblock=1024's), so coltile/stages set its shape; parsmem is
//             ignored. Rows of > 512 threads (16384) keep the parkeep=0 kernel. Same
//             results as parkeep=0 bit for bit (same items, same elementwise math).
//             The default since the H100 sweep of 2026-11-23 (bench/results/norm_variants_*,
//             kernel time, fwd + row+col e4m3, 16384 rows): with parstages=3, 151.0 / 310.4 us
//             at 4096 / 8192 (88.1% / 85.7% of copy) against parkeep=0's 154.9 / 323.4 us;
//             with 2 stages it was slower (159.6 / 332.5), and so was stages=3 without it.
//   parstages: row stages of the parkeep kernel (1..4; 0 = stages). 3 by default: the
//             parkeep kernel runs one 512-thread block per SM, so a third row in flight
//             covers the latency the halved occupancy exposes.
struct NormFwdTuning {
  int items = 16;
  int stages = 2;
  int block = 512;
  int colblock = 1024;
  int coltile = 0;
  int colspan = 32;
  int colorder = 1;
  int colsplit = 1;
  int l1keep = 0;
  int parsmem = 0;
  int colbar = 1;
  int parkeep = 1;
  int parstages = 3;
};

// Parses a LOWBIT_NORM_FWD_VARIANT value into *t (unset keys keep their value); false and
// *error on a malformed entry, an unknown key or a value out of range.
inline bool ParseNormFwdTuning(const char* text, NormFwdTuning* t, std::string* error) {
  std::string s = text == nullptr ? "" : text;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t end = s.find(',', pos);
    if (end == std::string::npos) end = s.size();
    const std::string item = s.substr(pos, end - pos);
    pos = end + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    int value = 0;
    bool ok = eq != std::string::npos && eq + 1 < item.size();
    for (size_t i = eq + 1; ok && i < item.size(); ++i) {
      ok = item[i] >= '0' && item[i] <= '9' && value < 100000;
      value = value * 10 + (item[i] - '0');
    }
    if (ok && key == "items" && (value == 8 || value == 16)) {
      t->items = value;
    } else if (ok && key == "stages" && value >= 1 && value <= 4) {
      t->stages = value;
    } else if (ok && key == "parstages" && value <= 4) {
      t->parstages = value;
    } else if (ok && key == "coltile" && (value == 0 || value == 4 || value == 8 ||
                                           value == 16 || value == 32)) {
      t->coltile = value;
    } else if (ok && key == "colspan" && (value == 32 || value == 64 || value == 128)) {
      t->colspan = value;
    } else if (ok && (key == "colorder" || key == "colsplit" || key == "l1keep" ||
                      key == "parsmem" || key == "colbar" || key == "parkeep") &&
               value <= 1) {
      (key == "colorder"   ? t->colorder
       : key == "colsplit" ? t->colsplit
       : key == "l1keep"   ? t->l1keep
       : key == "parsmem"  ? t->parsmem
       : key == "colbar"   ? t->colbar
                           : t->parkeep) = value;
    } else if (ok && (key == "block" || key == "colblock") && value >= 32 && value <= 1024 &&
               value % 32 == 0) {
      (key == "block" ? t->block : t->colblock) = value;
    } else {
      *error = "bad entry '" + item + "' (expected items=8|16, stages=1..4, block=32..1024, "
               "colblock=32..1024, blocks multiples of 32, coltile=0|4|8|16|32, "
               "colspan=32|64|128, colorder=0|1, colsplit=0|1, l1keep=0|1, parsmem=0|1, "
               "colbar=0|1, parkeep=0|1, parstages=0..4)";
      return false;
    }
  }
  return true;
}

// Row groups per backward block: the largest power of two that keeps the block at
// <= kNormBwdBlockThreads threads, at most 8 when a row group needs a named barrier (more
// than one warp: barriers 1..15, see RowGroupBarrier); 1 for rows of > 512 threads.
inline int NormBwdRowGroups(const RowGeometry& g) {
  int groups = 1;
  while (groups * 2 * g.threads_per_row <= kNormBwdBlockThreads &&
         (g.threads_per_row == 32 || groups * 2 <= 8)) {
    groups *= 2;
  }
  return groups;
}

// The most partial rows the backward pass can use: one per block, min(row tiles,
// kNormBwdMaxBlocks) blocks. The launcher may use fewer blocks (occupancy).
inline int64_t NormBwdMaxParts(int64_t rows, const RowGeometry& g) {
  const int64_t groups = NormBwdRowGroups(g);
  const int64_t tiles = (rows + groups - 1) / groups;
  return tiles < kNormBwdMaxBlocks ? tiles : kNormBwdMaxBlocks;
}

// Bytes of device workspace the backward pass needs for x of `x_dtype` viewed as rows x
// hidden: fp32 [2][parts][hidden] (dgamma partials, then dbeta partials; both halves are
// written for RMSNorm too), sized for the larger of the vectorized and the scalar plan (the
// launcher picks one from the pointers' alignment). 0 for an empty or unsupported shape.
inline size_t NormBackwardWorkspaceBytes(DType x_dtype, int64_t rows, int64_t hidden) {
  if (rows <= 0 || hidden <= 0 || hidden > kNormMaxHidden || !IsHighPrecision(x_dtype)) return 0;
  const int elem_bytes = x_dtype == DType::kF32 ? 4 : 2;
  int64_t parts = 0;
  for (bool aligned : {false, true}) {
    const int64_t p = NormBwdMaxParts(rows, ChooseRowGeometry(hidden, elem_bytes, aligned));
    parts = p > parts ? p : parts;
  }
  return size_t(2) * size_t(parts) * size_t(hidden) * sizeof(float);
}

}  // namespace lowbit
