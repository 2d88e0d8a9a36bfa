"""Probe: how fast does XLA run jax.lax.ragged_dot (MoE's grouped GEMM) on this GPU, in bf16
and with FP8 operands, against one dense GEMM of the same total size? Decides whether a
grouped dense can ride on XLA's ragged dot or needs a grouped GEMM op of lowbit's own.

Prints, per variant, the time per call (bench.common.time_fn), TFLOP/s of the useful work
(2 M K N, M the total rows) and the custom calls / fusions the compiled program holds.

    python tools/probe_ragged_dot.py [--groups 8] [--m 16384] [--k 4096] [--n 8192]
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench import common  # noqa: E402


def kernels(fn, *args) -> str:
    text = jax.jit(fn).lower(*args).compile().as_text()
    calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
    fusions = sorted(set(re.findall(r"kind=(k\w+)", text)))
    return f"custom calls {calls}, fusion kinds {fusions}"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    # uneven group sizes summing to m (multiples of 16 except one)
    cuts = np.sort(rng.choice(np.arange(1, a.m // 16), a.groups - 1, replace=False)) * 16
    sizes = np.diff(np.concatenate([[0], cuts, [a.m]])).astype(np.int32)
    sizes[0] += 3
    sizes[-1] -= 3
    gs = jnp.asarray(sizes)
    x = jnp.asarray(rng.standard_normal((a.m, a.k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((a.groups, a.k, a.n)) * 0.02, jnp.bfloat16)
    flops = 2.0 * a.m * a.k * a.n
    print(f"device {common.device_name()}, groups {a.groups} sizes {sizes.tolist()}, m {a.m} k {a.k} n {a.n}")

    def report(name, fn, *args):
        try:
            t = common.time_fn(fn, [args], iters=a.iters)
            print(f"{name:38s} {t * 1e3:8.3f} ms {flops / t / 1e12:7.1f} TFLOP/s   {kernels(fn, *args)}")
        except Exception as e:  # a variant XLA cannot compile is a result too
            print(f"{name:38s} failed: {type(e).__name__}: {str(e)[:300]}")

    report("dense bf16 dot (m,k)x(k,n)", lambda x, w: x @ w[0], x, w)
    report("ragged_dot bf16", lambda x, w, g: jax.lax.ragged_dot(x, w, g), x, w, gs)
    x8, w8 = x.astype(jnp.float8_e4m3fn), (w * 50).astype(jnp.float8_e4m3fn)
    report("dense fp8 dot -> f32", lambda x, w: jax.lax.dot(x, w[0], preferred_element_type=jnp.float32), x8, w8)
    report("ragged_dot fp8 -> f32", lambda x, w, g: jax.lax.ragged_dot(x, w, g, preferred_element_type=jnp.float32),
           x8, w8, gs)
    report("ragged_dot fp8 -> bf16", lambda x, w, g: jax.lax.ragged_dot(x, w, g, preferred_element_type=jnp.bfloat16),
           x8, w8, gs)
    # wgrad form: ragged contracting dim (x^T dy per group) -> (groups, k, n)
    dy = jnp.asarray(rng.standard_normal((a.m, a.n)), jnp.bfloat16)
    dn = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    report("ragged_dot_general bf16 wgrad", lambda x, d, g: jax.lax.ragged_dot_general(x, d, g, dn), x, dy, gs)
    report("ragged_dot_general fp8 wgrad -> f32",
           lambda x, d, g: jax.lax.ragged_dot_general(x, d, g, dn, preferred_element_type=jnp.float32),
           x8, dy.astype(jnp.float8_e5m2), gs)


if __name__ == "__main__":
    main()
