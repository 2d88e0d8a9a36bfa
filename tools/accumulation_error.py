"""What the backward GEMMs' accumulation costs in accuracy, at the seed Dense's shape: dx and
dk of one fwd+bwd from bf16 Flax-style dense, from lowbit.dense with a recipe's default
accumulation (split dgrad and wgrad) and with fp8_gemm_dgrad / fp8_gemm_wgrad at fast
accumulation, each against an fp32 reference (the unquantized product at
Precision.HIGHEST). Prints relative Frobenius errors; a measurement for the closing notes and
docs, not a test (tests/test_gemm_accumulation.py bounds the fast-vs-split gap).

    python tools/accumulation_error.py            # GPU, seed shape (m 16384, k 8192, n 32768)
    python tools/accumulation_error.py --small    # CPU: one accumulation there, equal errors
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import lowbit
from lowbit.quantize import QuantizerFactory
from lowbit.recipe import Float8CurrentScaling, MMParams

FAST = MMParams(use_split_accumulator=False)


def rel(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args(argv)
    m, k, n = (256, 512, 1024) if args.small else (16384, 8192, 32768)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    kernel = jax.random.normal(keys[1], (k, n), jnp.float32) * 0.01
    dy = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
    hi = jax.lax.Precision.HIGHEST

    @jax.jit
    def reference(x, kernel, dy):
        x32, dy32 = x.astype(jnp.float32), dy.astype(jnp.float32)
        return jnp.dot(dy32, kernel.T, precision=hi), jnp.dot(x32.T, dy32, precision=hi)

    @jax.jit
    def bf16(x, kernel, dy):
        _, vjp = jax.vjp(lambda x, k: jnp.dot(x, k.astype(jnp.bfloat16)), x, kernel)
        return vjp(dy)

    def lowbit_grads(recipe):
        @jax.jit
        def fn(x, kernel, dy):
            _, vjp = jax.vjp(lambda x, k: lowbit.dense(x, k, quantizer_set=QuantizerFactory.create_set(recipe)),
                             x, kernel)
            return vjp(dy)
        return fn(x, kernel, dy)

    dx_ref, dk_ref = reference(x, kernel, dy)
    rows = {"bf16": bf16(x, kernel, dy)}
    for name, recipe in (("current_split", Float8CurrentScaling()),
                         ("current_fast_bwd", Float8CurrentScaling(fp8_gemm_dgrad=FAST, fp8_gemm_wgrad=FAST))):
        rows[name] = lowbit_grads(recipe)
    # Float8CurrentScaling: its scales are this step's amaxes, what DelayedScaling's become once
    # the history holds them (its first step casts with scale 1).
    print(f"device {jax.devices()[0].device_kind}, m {m}, k {k}, n {n}; relative error vs fp32 (HIGHEST)")
    print(f"{'variant':18s} {'dx':>10s} {'dk':>10s}")
    for name, (dx, dk) in rows.items():
        print(f"{name:18s} {rel(dx, dx_ref):10.3e} {rel(dk, dk_ref):10.3e}")
    (dx_s, dk_s), (dx_f, dk_f) = rows["current_split"], rows["current_fast_bwd"]
    print(f"fast vs split: dx {rel(dx_f, dx_s):.3e}, dk {rel(dk_f, dk_s):.3e}")


if __name__ == "__main__":
    main()
