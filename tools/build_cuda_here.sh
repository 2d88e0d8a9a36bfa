#!/usr/bin/env bash
# Builds lowbit's two libraries for sm_90a on this machine (nvcc, no GPU needed) into
# build/cuda, so that a device round carries them instead of building there: a fresh device
# machine spends ~4.5 minutes of the session's device time on `pip install -e .`, a carried
# build none. The first run configures and builds everything (long on 2 cores); later runs
# rebuild what changed. The libraries must match the device's jax (jaxlib's FFI headers come
# from $PYTHON's jax; the device has jax 0.11.2).
#
#   PYTHON=/work/venv/bin/python bash tools/build_cuda_here.sh
#   then, through the device tool: carry ["build/cuda/liblowbit_cuda.so", "build/cuda/liblowbit.so"],
#   command "LIB_DIR=build/cuda TESTS=... tools/gpu_round.sh" (falls back to building there
#   when the carried libraries do not load).
# BUILD_DIR (default build/cuda) builds elsewhere, e.g. a second build of a variant for an A/B
# run in one device call: the two libraries (~23 MB each) fit the carry's 64 MiB together;
# run the benchmark once per LOWBIT_LIBRARY_DIR there.
set -euo pipefail
PY=${PYTHON:-python3}
B=${BUILD_DIR:-build/cuda}
ARCH=${LOWBIT_CUDA_ARCH_FLAGS:--gencode=arch=compute_90a,code=sm_90a}
if [ ! -f "$B/build.ninja" ]; then
  cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOWBIT_CUDA=ON \
    "-DLOWBIT_CUDA_ARCH_FLAGS=$ARCH" "-DPython_EXECUTABLE=$("$PY" -c 'import sys; print(sys.executable)')"
fi
ninja -C "$B" liblowbit_cuda.so liblowbit.so
ls -la "$B"/liblowbit_cuda.so "$B"/liblowbit.so
