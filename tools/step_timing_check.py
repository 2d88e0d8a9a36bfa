"""Does the way a benchmark step is called change its time? Times one variant of the seed
Dense (bench/bench_dense.py) three ways in one process, round-robin, and lists the kernels of
the first two side by side (a jax.profiler trace of each):

  direct     the step itself (examples/quickstart_jax_utils.make_step's jitted program), called
             in a loop, as tools/trace_step.py times it;
  time_fn    bench/common.time_fn over the step without its passed-through variables, as
             bench_dense.py times it (the step traced inside another jit);
  jit(fn)    that function under one jit of its own, in a loop.

    python tools/step_timing_check.py module_delayed [--rounds 3] [--iters 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import jax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "bench"))
import common  # noqa: E402
import trace_step  # noqa: E402


def loop_ms(f, args, iters):
    r = None
    for _ in range(3):
        r = f(*args)
    jax.block_until_ready(r)
    start = time.perf_counter()
    for _ in range(iters):
        r = f(*args)
    jax.block_until_ready(r)
    return (time.perf_counter() - start) / iters * 1e3


def kernels(f, args, steps=5):
    """{kernel name: device us per step} of `steps` traced calls of f."""
    jax.block_until_ready(f(*args))
    _, by_name = trace_step.traced_kernels(f, args, steps, tempfile.mkdtemp())
    return {name: us for name, (us, _) in by_name.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variant")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke run)")
    a = p.parse_args()
    if a.variant.endswith("_unfused"):
        from lowbit.dense import DENSE_BACKWARD_ENV
        os.environ[DENSE_BACKWARD_ENV] = "unfused"
    step, args = trace_step.build("dense", a.variant, a.small)
    fn = lambda v, x, dy: step(v, x, dy)[1:]  # noqa: E731  (as bench/common.py's _step_outputs)
    jit_fn = jax.jit(fn)
    outer = jax.jit(lambda *sets: [fn(*s) for s in sets])  # time_fn's program
    ways = {
        "direct": lambda: loop_ms(step, args, a.iters),
        "time_fn": lambda: common.time_fn(fn, [args], a.iters, repeats=2, warmup=2) * 1e3,
        "jit(fn)": lambda: loop_ms(jit_fn, args, a.iters),
    }
    for r in range(a.rounds):
        print(f"round {r + 1} {a.variant}: " + ", ".join(f"{k} {f():.3f} ms" for k, f in ways.items()), flush=True)
    kd = kernels(step, args)
    ko = kernels(lambda *x: outer(x), args)
    print(f"{a.variant} device busy per step: direct {sum(kd.values()) / 1e3:.3f} ms, "
          f"time_fn's program {sum(ko.values()) / 1e3:.3f} ms")
    print(f"{'direct us':>10s} {'time_fn us':>10s}  kernel")
    for name in sorted(set(kd) | set(ko), key=lambda n: -max(kd.get(n, 0), ko.get(n, 0)))[:24]:
        print(f"{kd.get(name, 0):10.1f} {ko.get(name, 0):10.1f}  {name[:100]}")


if __name__ == "__main__":
    main()
