"""Is a benchmarked step host-bound? Times one variant's jitted training step of the seed
Dense or layer (the steps tools/trace_step.py builds) four ways: the host's dispatch of
`iters` back-to-back calls (the loop returning, before any wait), the same loop to
completion, one call at a time with a wait after each, and the benchmark's own clock
(bench/common.time_step). Dispatch close to completion means the host, not the GPU, sets
the pace; completion well above trace_step's device-busy time means the GPU sat idle.

    python tools/dispatch_time.py dense module_delayed,lowbit_delayed [--iters 20]
    python tools/dispatch_time.py layer fused_delayed
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from trace_step import build  # noqa: E402  (also puts bench/ and examples/ on the path)

import common  # noqa: E402  (bench/common.py)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=["dense", "layer"])
    parser.add_argument("variants", help="comma-separated variants of that benchmark")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke run)")
    args = parser.parse_args(argv)
    n = args.iters
    for name in args.variants.split(","):
        step, step_args = build(args.which, name, args.small)
        jax.block_until_ready(step(*step_args))
        t0 = time.perf_counter()
        for _ in range(n):
            out = step(*step_args)  # only the last kept: n steps' outputs may not fit
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        single = []
        for _ in range(5):
            t = time.perf_counter()
            jax.block_until_ready(step(*step_args))
            single.append(time.perf_counter() - t)
        bench_ms = common.time_step(step, *step_args, n)["ms"]
        print(f"{args.which} {name}: dispatch {(t1 - t0) / n * 1e3:.3f} ms/step, to completion "
              f"{(t2 - t0) / n * 1e3:.3f} ms/step, one at a time {min(single) * 1e3:.3f} ms, "
              f"common.time_step {bench_ms:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
