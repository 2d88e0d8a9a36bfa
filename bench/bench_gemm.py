"""bench_gemm: TFLOP/s of lowbit_gemm (cuBLASLt FP8, fast and split accumulation) against
jnp bf16 dot_general and the FP8 dot_general XLA compiles itself, on the same TN problems.

Shapes (M, N, K), out = a (M, K) @ b (N, K)^T in bf16:
  square      8192^3
  dense_fwd   the seed Dense layer: x (8*2048, 8192) @ W (8192 -> 32768)
  dense_dgrad dX = dY (16384, 32768) @ W^T: M=16384, N=8192,  K=32768 (E5M2 x E4M3)
  dense_wgrad dW = X^T @ dY:               M=8192,  N=32768, K=16384 (E4M3 x E5M2)
Ratios are to bf16 in the same run. `--small` runs tiny shapes on the CPU as a smoke test.

`--algo-sweep` instead times lowbit_gemm at every cuBLASLt heuristic index (the `algo` of
lowbit.ops.gemm, LOWBIT_GEMM_ALGO) on the three dense shapes, per kind: per-tensor FP8 as
lowbit.dense runs it (fast accumulation forward, split dgrad / wgrad) and FP8 block scaling
(x 1x128 with W 128x128 forward and dgrad, 1x128 x 1x128 wgrad). Per (shape, kind) it walks
indices 0, 1, ... until cuBLASLt has no more (or --max-algo), prints TFLOP/s per index and
the best index against index 0: what DEFAULT_ALGO in lowbit/ops/gemm_config.py should hold.
`--out-dtype float32` sweeps with the f32 output lowbit's module writes an f32 kernel's
wgrad in (cuBLASLt's heuristic orders the algorithms per output type).

  python bench/bench_gemm.py            # GPU
  python bench/bench_gemm.py --algo-sweep [--max-algo 16]
  JAX_PLATFORMS=cpu python bench/bench_gemm.py --small [--algo-sweep]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from common import print_table, time_fn, write_results

import lowbit
from lowbit.ops.gemm import GemmScaleMode, scale_shape

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


B1, B128 = GemmScaleMode.BLOCK_1x128, GemmScaleMode.BLOCK_128x128
# name: per-tensor kind (its use_split_accumulator) and the block (a, b) mode pair, as
# lowbit.dense runs each GEMM.
SWEEP_KINDS = {
    "dense_fwd": (("fp8_fast", False), (B1, B128)),
    "dense_dgrad": (("fp8_split", True), (B1, B128)),
    "dense_wgrad": (("fp8_split", True), (B1, B1)),
}


def sweep_inputs(m, n, k, a_dtype, b_dtype, modes, seed):
    """FP8 operands and their scales: (1,) f32 per tensor, or the block arrays of `modes`."""
    ka, kb, ks = jax.random.split(jax.random.key(seed), 3)
    a = jax.random.normal(ka, (m, k), BF16).astype(a_dtype)
    b = jax.random.normal(kb, (n, k), BF16).astype(b_dtype)
    if modes is None:
        return a, b, jnp.full((1,), 0.5, jnp.float32), jnp.full((1,), 2.0, jnp.float32)
    ksa, ksb = jax.random.split(ks)
    sa = jax.random.uniform(ksa, scale_shape(modes[0], m, k), jnp.float32, 0.5, 2.0)
    sb = jax.random.uniform(ksb, scale_shape(modes[1], n, k), jnp.float32, 0.5, 2.0)
    return a, b, sa, sb


def algo_sweep(args, table, iters, repeats):
    """The --algo-sweep mode (see the module docstring); returns result rows."""
    rows = []
    for name in args.shapes or [s for s in SWEEP_KINDS if s in table]:
        m, n, k, a_dtype, b_dtype = table[name]
        (tensor_kind, split), block_modes = SWEEP_KINDS[name]
        flops = 2.0 * m * n * k
        for kind, modes in ((tensor_kind, None), ("block", block_modes)):
            label = kind if modes is None else f"block_{modes[0].name[6:]}x{modes[1].name[6:]}"
            sets = [sweep_inputs(m, n, k, a_dtype, b_dtype, modes, seed) for seed in range(2)]
            mode_kw = {} if modes is None else dict(a_scale_mode=modes[0], b_scale_mode=modes[1])
            times = {}
            for algo in range(args.max_algo):
                fn = (lambda a, b, sa, sb, algo=algo: lowbit.ops.gemm(
                    a, b, sa, sb, out_dtype=args.out_dtype, use_split_accumulator=split, algo=algo,
                    **mode_kw))
                try:
                    t = time_fn(fn, sets, iters=iters, repeats=repeats, warmup=1 if args.small else 3)
                except Exception as e:  # noqa: BLE001 (XlaRuntimeError)
                    msg = str(e).splitlines()[0]
                    if "heuristic algorithms for" in str(e):
                        print(f"{name} {label}: cuBLASLt offers {algo} algorithms", flush=True)
                        break
                    print(f"{name} {label} algo {algo}: failed: {type(e).__name__}: {msg}", flush=True)
                    break  # not an index problem: the next indices fail alike
                times[algo] = t
                print(f"{name} {label} algo {algo}: {t * 1e3:.3f} ms, {flops / t / 1e12:.0f} TFLOP/s",
                      flush=True)
                rows.append({"shape": name, "M": m, "N": n, "K": k, "kind": kind, "modes": label,
                             "out_dtype": jnp.dtype(args.out_dtype).name,
                             "algo": algo, "time_ms": t * 1e3, "tflops": flops / t / 1e12,
                             "x_algo0": times[0] / t if 0 in times else None})
            if times:
                best = min(times, key=times.get)
                base = f", {times[0] / times[best]:.3f}x index 0" if 0 in times else ""
                print(f"{name} {label}: best algo {best} ({flops / times[best] / 1e12:.0f} TFLOP/s{base})",
                      flush=True)
            del sets
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes, for a CPU smoke run")
    parser.add_argument("--shapes", nargs="*", default=None, help=f"subset of {list(SHAPES)}")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--algo-sweep", action="store_true",
                        help="time every cuBLASLt heuristic index instead (see the module docstring)")
    parser.add_argument("--max-algo", type=int, default=16, help="--algo-sweep: indices 0..N-1 at most")
    parser.add_argument("--out-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="--algo-sweep: the GEMMs' output dtype")
    args = parser.parse_args()
    table = SMALL_SHAPES if args.small else SHAPES
    iters = args.iters or (2 if args.small else 20)
    repeats = args.repeats or (1 if args.small else 5)
    if args.algo_sweep:
        if args.small:
            args.max_algo = min(args.max_algo, 2)
        rows = algo_sweep(args, table, iters, repeats)
        print_table(rows, ["shape", "M", "N", "K", "modes", "algo", "time_ms", "tflops", "x_algo0"])
        path = write_results("gemm_algo_sweep" + ("_f32" if args.out_dtype == "float32" else ""), {"rows": rows, "small": args.small, "iters": iters,
                                                 "repeats": repeats})
        print(f"wrote {path}")
        return
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
