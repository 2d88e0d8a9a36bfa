"""How much of a benchmark's per-call time is the fixed cost of launching one executable:
times a few memory-bound ops one call per program and several calls per program
(bench/common.py time_fn, per_program False / True), beside the copy ceiling.

    python tools/timing_probe.py
"""

from __future__ import annotations

import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import common  # noqa: E402

from lowbit.ops import quantize_fp8  # noqa: E402


def main():
    rng = np.random.default_rng(0)
    sets = [(jnp.asarray(rng.standard_normal((16384, 8192), np.float32), jnp.bfloat16),
             jnp.ones((1,), jnp.float32)) for _ in range(4)]
    n = 16384 * 8192
    cases = {
        "copy x+1 (bf16)": (lambda x, s: x + 1, 4 * n),
        "quantize rowwise": (lambda x, s: quantize_fp8(x, s, rowwise=True, colwise=False), 3 * n),
        "quantize both": (lambda x, s: quantize_fp8(x, s, rowwise=True, colwise=True), 4 * n),
    }
    print(f"{'case':20s} {'1/program us':>13s} {'4/program us':>13s} {'GB/s (4/prog)':>14s}")
    for name, (fn, nbytes) in cases.items():
        t1 = common.time_fn(fn, sets, per_program=False)
        t4 = common.time_fn(fn, sets, per_program=True)
        print(f"{name:20s} {t1 * 1e6:13.1f} {t4 * 1e6:13.1f} {nbytes / t4 / 1e9:14.0f}")


if __name__ == "__main__":
    main()
