#!/usr/bin/env bash
# Creates .venv with Python >= 3.12 (jax 0.11.2 needs it), installs the pinned
# dependencies and builds lowbit into it (editable). Used by the README's two commands.
#   tools/setup_env.sh [requirements file]   (default requirements-dev.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
req=${1:-requirements-dev.txt}

find_python() {
  for cand in "${PYTHON:-}" python3.12 python3.13 python3 \
              "$HOME"/.pyenv/versions/3.12*/bin/python3 "$HOME"/.pyenv/versions/3.13*/bin/python3; do
    [ -n "$cand" ] || continue
    command -v "$cand" >/dev/null 2>&1 || continue
    if "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  return 1
}

if [ ! -x .venv/bin/python ]; then
  py=$(find_python) || { echo "lowbit: needs Python >= 3.12 (set PYTHON=/path/to/python3.12)" >&2; exit 1; }
  echo "lowbit: creating .venv with $py"
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r "$req"
export PATH="$PATH:/usr/local/cuda/bin"
# The CUDA library is built when a GPU is visible (or LOWBIT_CUDA=ON/AUTO asks for it):
# without a GPU it would only cost compile time.
if [ -z "${LOWBIT_CUDA:-}" ]; then
  if command -v nvcc >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then LOWBIT_CUDA=ON; else LOWBIT_CUDA=OFF; fi
fi
export LOWBIT_CUDA
echo "lowbit: building (LOWBIT_CUDA=$LOWBIT_CUDA)"
.venv/bin/python -m pip install -q --no-build-isolation --no-deps -e .
