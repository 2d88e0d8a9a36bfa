"""The fused Dense backward (lowbit.ops.dense_backward_fp8) at each cuBLASLt heuristic index of
one of its GEMM kinds, timed round-robin beside the unfused ops (quantize + two GEMMs, what the
op computes without placing dy's copies in dk): which index its slices run fastest at.

The fused op runs its wgrad as column slices (a batched launch, then one launch per slice,
in order; csrc/dense/dense_backward.h), each a problem cuBLASLt ranks on its own, so the
standalone wgrad's best index (bench_gemm.py --algo-sweep) need not be the slices' best.

    python tools/sweep_fused_backward.py                        # seed Dense shapes, fused_wgrad 0..7
    python tools/sweep_fused_backward.py --kind fused_dgrad --indices 0,1,2
    python tools/sweep_fused_backward.py --small               # tiny shapes (runs on the CPU)

An index past the list cuBLASLt returns for a problem fails that variant (reported, not
timed). Prints one line per variant and round as it goes, then the table; writes
bench/results/fused_backward_sweep_<device>.json. Speed is compared inside one process and one
card state only (rounds interleave the variants); the step-level check is bench_dense.py
--algo KIND=INDEX.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import common  # noqa: E402  (bench/common.py)

ALGO_ENV = "LOWBIT_GEMM_ALGO"


def inputs(m: int, n: int, k: int):
    """The op's arguments as the seed Dense's backward has them: dy bf16, x's colwise and the
    kernel's rowwise E4M3 copies, dy quantized to E5M2 (DelayedScaling's HYBRID), scales near
    what delayed scaling would hold."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    dy = jax.random.normal(keys[0], (m, n), jnp.bfloat16)
    x_col = (jax.random.normal(keys[1], (k, m), jnp.float32) * 64).astype(jnp.float8_e4m3fn)
    k_row = (jax.random.normal(keys[2], (k, n), jnp.float32) * 64).astype(jnp.float8_e4m3fn)
    one = lambda v: jnp.full((1,), v, jnp.float32)  # noqa: E731
    return dy, x_col, k_row, one(4096.0), one(1 / 4096.0), one(1 / 64.0), one(1 / 64.0)


def variant(dense_backward, kind: str | None, index: int | None, fused: bool):
    """The op as one jitted function, traced now under LOWBIT_GEMM_ALGO=kind=index (the
    variable is read at trace time)."""
    kw = dict(q_code=5, dx_dtype=jnp.dtype(jnp.bfloat16), dk_dtype=jnp.dtype(jnp.float32), dbias=True,
              dbias_dtype=jnp.dtype(jnp.bfloat16), allow_fused=fused)
    fn = jax.jit(lambda *a: dense_backward._local(*a, **kw))
    return fn, (f"{kind}={index}" if kind is not None else "")


def time_compiled(exe, operands, iters: int, repeats: int = 2) -> float:
    """Median seconds per call of a compiled executable, run `iters` times back to back
    (common.time_fn would jit it again, tracing it outside its LOWBIT_GEMM_ALGO value)."""
    jax.block_until_ready(exe(*operands))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = None
        for _ in range(iters):
            out = exe(*operands)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="fused_wgrad", choices=["fused_wgrad", "fused_dgrad"])
    parser.add_argument("--indices", default="0,1,2,3,4,5,6,7")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args(argv)
    m, n, k = (256, 2048, 512) if args.small else (8 * 2048, 32768, 8192)
    iters = args.iters or (2 if args.small else 20)
    dense_backward = importlib.import_module("lowbit.ops.dense_backward")
    plan = dense_backward.dense_backward_plan(m, n, k, jnp.float32, jnp.bfloat16, True)
    print(f"device {common.device_name()}; dy ({m}, {n}) bf16, dk ({k}, {n}) f32: plan (slices, scratch bytes) "
          f"{plan}; {args.kind} indices {args.indices}", flush=True)
    operands = inputs(m, n, k)
    cases = {"unfused": variant(dense_backward, None, None, False)}
    for i in (int(v) for v in args.indices.split(",")):
        cases[f"{args.kind}={i}"] = variant(dense_backward, args.kind, i, True)
    compiled, failed = {}, {}
    for name, (fn, algo) in cases.items():
        old = os.environ.get(ALGO_ENV)
        os.environ[ALGO_ENV] = algo
        try:
            exe = fn.lower(*operands).compile()
            jax.block_until_ready(exe(*operands))  # an index past cuBLASLt's list fails here
            compiled[name] = exe
        except Exception as e:  # noqa: BLE001  (reported per variant; the others still run)
            failed[name] = str(e).splitlines()[0][:200]
            print(f"{name}: failed: {failed[name]}", flush=True)
        finally:
            if old is None:
                os.environ.pop(ALGO_ENV, None)
            else:
                os.environ[ALGO_ENV] = old
    times = {name: [] for name in compiled}
    for r in range(args.rounds):
        for name, exe in compiled.items():
            t = time_compiled(exe, operands, iters)
            times[name].append(t * 1e3)
            print(f"round {r + 1}/{args.rounds} {name}: {t * 1e3:.3f} ms", flush=True)
    rows = []
    base = statistics.median(times["unfused"]) if "unfused" in times else None
    for name, ts in times.items():
        ms = statistics.median(ts)
        rows.append({"variant": name, "ms": ms, "x unfused": (base / ms) if base else None,
                     "rounds": " ".join(f"{t:.3f}" for t in ts)})
    common.print_table(rows, ["variant", "ms", "x unfused", "rounds"])
    fused = [r for r in rows if r["variant"] != "unfused"]
    if fused:
        best = min(fused, key=lambda r: r["ms"])
        print(f"best {best['variant']}: {best['ms']:.3f} ms", flush=True)
    path = common.write_results("fused_backward_sweep", {"m": m, "n": n, "k": k, "plan": plan, "kind": args.kind,
                                                         "rows": rows, "failed": failed})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
