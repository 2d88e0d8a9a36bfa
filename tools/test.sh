#!/usr/bin/env bash
# The whole test suite on this machine: sets up .venv (tools/setup_env.sh), builds and
# runs the C++ tests (ctest), then pytest on JAX's default backend (the CPU without a
# GPU). Exits non-zero on any failure. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
# Tests build the CUDA library whenever nvcc is there (AUTO), GPU or not: CI has no GPU,
# and this is how it notices CUDA code that no longer compiles.
LOWBIT_CUDA=${LOWBIT_CUDA:-AUTO} bash tools/setup_env.sh requirements-dev.txt
py=.venv/bin/python
export PATH="$PWD/.venv/bin:$PATH"   # the pinned cmake and ninja

echo "== C++ tests"
cmake -G Ninja -S . -B build/ctest -DPython_EXECUTABLE="$py" -DLOWBIT_CUDA=OFF \
      -DLOWBIT_BUILD_TESTS=ON >/dev/null
cmake --build build/ctest
(cd build/ctest && ctest --output-on-failure)

echo "== Python tests"
"$py" -m lowbit --no-demo
"$py" -m pytest -q -n 2 -p no:cacheprovider tests "$@"
