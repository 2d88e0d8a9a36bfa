// GpuStream: the CUDA stream type, declared without the CUDA headers so that launcher
// headers stay includable from host-only code (cudaStream_t is CUstream_st*).
#pragma once

struct CUstream_st;

namespace lowbit {
using GpuStream = CUstream_st*;
}  // namespace lowbit
