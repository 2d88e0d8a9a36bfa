"""bench_gemm: TFLOP/s of lowbit_gemm (cuBLASLt FP8, fast and split accumulation) against
jnp bf16 dot_general and the FP8 dot_general XLA compiles itself, on the same TN problems.

Shapes (M, N, K), out = a (M, K) @ b (N, K)^T in bf16:
  square      8192^3
  dense_fwd   the seed Dense layer: x (8*2048, 8192) @ W (8192 -> 32768)
  dense_dgrad dX = dY (16384, 32768) @ W^T: M=16384, N=8192,  K=32768 (E5M2 x E4M3)
  dense_wgrad dW = X^T @ dY:               M=8192,  N=32768, K=16384 (E4M3 x E5M2)
Ratios are to bf16 in the same run. `--small` runs tiny shapes on the CPU as a smoke test.

  python bench/bench_gemm.py            # GPU
  JAX_PLATFORMS=cpu python bench/bench_gemm.py --small
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from common import print_table, time_fn, write_results

import lowbit

E4M3, E5M2, BF16 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16
TN = (((1,), (1,)), ((), ()))  # contract a's and b's last dims

SHAPES = {  # name: (M, N, K, a dtype, b dtype)
    "square": (8192, 8192, 8192, E4M3, E4M3),
    "dense_fwd": (16384, 32768, 8192, E4M3, E4M3),
    "dense_dgrad": (16384, 8192, 32768, E5M2, E4M3),
    "dense_wgrad": (8192, 32768, 16384, E4M3, E5M2),
}
SMALL_SHAPES = {
    "square": (256, 256, 256, E4M3, E4M3),
    "dense_fwd": (128, 512, 256, E4M3, E4M3),
    "dense_dgrad": (128, 256, 512, E5M2, E4M3),
    "dense_wgrad": (256, 512, 128, E4M3, E5M2),
}


def methods():
    def lowbit_fp8(split):
        return lambda a8, b8, a16, b16, sa, sb: lowbit.ops.gemm(
            a8, b8, sa, sb, out_dtype=BF16, use_split_accumulator=split)

    def xla_fp8(a8, b8, a16, b16, sa, sb):
        acc = jax.lax.dot_general(a8, b8, TN, preferred_element_type=jnp.float32)
        return (acc * (sa * sb)).astype(BF16)

    def bf16(a8, b8, a16, b16, sa, sb):
        return jax.lax.dot_general(a16, b16, TN, preferred_element_type=BF16)

    return {
        "bf16_dot": bf16,
        "lowbit_fp8_fast": lowbit_fp8(False),
        "lowbit_fp8_split": lowbit_fp8(True),
        "xla_fp8_dot": xla_fp8,
    }


def inputs(m, n, k, a_dtype, b_dtype, seed):
    ka, kb = jax.random.split(jax.random.key(seed))
    a16 = jax.random.normal(ka, (m, k), BF16)
    b16 = jax.random.normal(kb, (n, k), BF16)
    sa = jnp.ones((1,), jnp.float32) * 0.5
    sb = jnp.ones((1,), jnp.float32) * 2.0
    return (a16.astype(a_dtype), b16.astype(b_dtype), a16, b16, sa, sb)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes, for a CPU smoke run")
    parser.add_argument("--shapes", nargs="*", default=None, help=f"subset of {list(SHAPES)}")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    table = SMALL_SHAPES if args.small else SHAPES
    iters = args.iters or (2 if args.small else 20)
    repeats = args.repeats or (1 if args.small else 5)
    rows = []
    for name in args.shapes or list(table):
        m, n, k, a_dtype, b_dtype = table[name]
        sets = [inputs(m, n, k, a_dtype, b_dtype, seed) for seed in range(2)]
        flops = 2.0 * m * n * k
        times = {}
        for method, fn in methods().items():
            try:
                times[method] = time_fn(fn, sets, iters=iters, repeats=repeats, warmup=1 if args.small else 3)
                print(f"{name} {method}: {times[method] * 1e3:.3f} ms, "
                      f"{flops / times[method] / 1e12:.0f} TFLOP/s", flush=True)
            except Exception as e:  # e.g. XLA without an FP8 dot on this device
                print(f"{name} {method}: failed: {type(e).__name__}: {str(e).splitlines()[0]}")
        for method, t in times.items():
            rows.append({
                "shape": name, "M": m, "N": n, "K": k,
                "types": f"{jnp.dtype(a_dtype).name}x{jnp.dtype(b_dtype).name}",
                "method": method, "time_ms": t * 1e3, "tflops": flops / t / 1e12,
                "x_bf16": times["bf16_dot"] / t if "bf16_dot" in times else None,
                "x_xla_fp8": times["xla_fp8_dot"] / t if "xla_fp8_dot" in times else None,
            })
        del sets
    print_table(rows, ["shape", "M", "N", "K", "types", "method", "time_ms", "tflops", "x_bf16", "x_xla_fp8"])
    path = write_results("gemm", {"rows": rows, "small": args.small, "iters": iters, "repeats": repeats})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
