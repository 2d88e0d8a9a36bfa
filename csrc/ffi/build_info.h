// Version numbers compiled into the libraries. Bump LOWBIT_ABI_VERSION (and
// lowbit/_ffi.py's ABI_VERSION) whenever a handler's signature or a target changes.
#pragma once

#define LOWBIT_ABI_VERSION 1
#define LOWBIT_ABI_STR "1"
#ifndef LOWBIT_VERSION_STRING
#define LOWBIT_VERSION_STRING "0.1.0"
#endif
#if defined(LOWBIT_CUDA_HANDLERS) && defined(LOWBIT_CUDA_ARCH_FLAGS_STRING)
#define LOWBIT_BUILD_FLAVOR "cuda=" LOWBIT_CUDA_VERSION_STRING " " LOWBIT_CUDA_ARCH_FLAGS_STRING
#elif defined(LOWBIT_CUDA_HANDLERS)
#define LOWBIT_BUILD_FLAVOR "cuda=" LOWBIT_CUDA_VERSION_STRING
#else
#define LOWBIT_BUILD_FLAVOR "cpu"
#endif
