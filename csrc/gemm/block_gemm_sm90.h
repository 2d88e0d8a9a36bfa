// block_gemm_sm90: lowbit's own FP8 block-scaled GEMM for Hopper (sm_90a), the alternative to
// cuBLASLt's block scaling for gemm.h's kBlock1x128 / kBlock128x128 pairs (1x128 x 128x128,
// 128x128 x 1x128, 1x128 x 1x128), with gemm.h's operands, scale layouts and TN layout.
//
// Numerics: for every 128-long K block j, the tensor cores sum the 128 FP8 products of the
// block in fp32 (their inner accumulation, as cuBLASLt's), the partial sum p_j is multiplied
// by fl(sa_j * sb_j) (the two operands' scales of that block) and added to an fp32 total in
// increasing j from +0: y = fl(total + bias[n]), rounded to out. This is cuBLASLt's order
// (gemm.h: "applies the scales per 128-long K block to fp32 partial sums"); the CPU
// emulation rounds every scaled product instead, and tests/gemm_block_reference.py
// (block_tolerance) bounds the difference.
//
// Which path runs: LOWBIT_BLOCK_GEMM=wgmma selects this kernel where it applies
// (BlockGemmSm90Applies); anything else (the default, "cublaslt") keeps cuBLASLt.
#pragma once

#include "common/gpu_stream.h"
#include "common/status.h"
#include "gemm/gemm.h"

namespace lowbit {

// True when LOWBIT_BLOCK_GEMM asks for this kernel (read at every call, so a test or a
// benchmark can switch paths between calls of one compiled program).
bool BlockGemmSm90Requested();

// True when the kernel takes `args` on a device of `capability` (major*10+minor): FP8 block
// pairs other than 128x128 x 128x128, capability 9.0, K and N multiples of 16 (lowbit.ops.gemm
// pads them), 16-byte aligned operands and scale arrays, no bias with an f32 output.
bool BlockGemmSm90Applies(const GemmArgs& args, int capability);

// Enqueues the GEMM on `stream` (device `device_ordinal`); no workspace, no host sync.
Status BlockGemmSm90Cuda(const GemmArgs& args, int device_ordinal, GpuStream stream);

}  // namespace lowbit
