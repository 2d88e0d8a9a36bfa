"""Where a benchmark step's device time goes: traces a few steps of the seed Dense
(bench/bench_dense.py) or the seed layer (bench/bench_layer.py) with jax.profiler (CUPTI
kernel events in a Perfetto trace) and prints the kernels grouped by name, per step,
beside the step's wall time; the difference is time the GPU sat idle.

    python tools/trace_step.py dense lowbit_delayed [--steps 3] [--out DIR]
    python tools/trace_step.py layer flax_fp8
    python tools/trace_step.py quantize lowbit
    python tools/trace_step.py dense module_delayed --sweep LOWBIT_QUANTIZE_TILE_VARIANT=,r256s2b8
        (one compiled step traced once per value of a knob the C++ launchers read at every
        call; an empty value unsets it)
    python tools/trace_step.py dense module_delayed_unfused --warmup 300
        (the kernels of a card at its power cap: an H100 running FP8 GEMMs back to back
        clocks down within seconds, so a few warm-up steps trace a faster card than the
        timed benchmark runs on; *_unfused sets LOWBIT_DENSE_BACKWARD=unfused as
        bench_dense.py does)
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

import jax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import common  # noqa: E402  (bench/common.py)


def build(which: str, variant: str, small: bool = False):
    """(step, args) of one variant of the seed Dense or layer benchmark."""
    import jax.numpy as jnp
    from quickstart_jax_utils import make_step

    if which == "quantize":  # the standalone fused cast-transpose (bench/bench_quantize.py "both")
        from lowbit.ops import quantize_fp8

        x = jax.random.normal(jax.random.PRNGKey(0), (256, 512) if small else (16384, 8192), jnp.bfloat16)
        step = jax.jit(lambda v, s: quantize_fp8(v, s, rowwise=True, colwise=True))
        return step, (x, jnp.ones((1,), jnp.float32))
    if which == "dense":
        import bench_dense as bench

        b, s, h, f = (2, 64, 256, 512) if small else (8, 2048, 8192, 32768)
        model = bench.variants()[variant](f)
        x = jax.random.normal(jax.random.PRNGKey(0), (b, s, h), jnp.bfloat16)
        dy = jax.random.normal(jax.random.PRNGKey(1), (b, s, f), jnp.bfloat16)
        variables = model.init(jax.random.PRNGKey(0), x)
        return make_step(model.apply, {}), (variables, x, dy)
    import bench_layer as bench
    from te_integration_layer import FlaxTransformerLayer

    key, dropout_key = jax.random.split(jax.random.PRNGKey(42))
    b, s, h, f, heads = (2, 64, 128, 512, 4) if small else (4, 2048, 4096, 16384, 32)
    x = jax.random.normal(key, (b, s, h)).astype(jnp.bfloat16)
    dy = jax.random.normal(key, (b, s, h)).astype(jnp.bfloat16)
    if variant in bench.FUSED_VARIANTS:
        from fused_layer import FusedTransformerLayer
        layer = FusedTransformerLayer(hidden_size=h, ffn_hidden_size=f, num_attention_heads=heads,
                                      quantization_recipe=bench.FUSED_VARIANTS[variant]())
    else:
        layer = FlaxTransformerLayer(hidden_size=h, ffn_hidden_size=f, num_attention_heads=heads,
                                     dot_general_cls=bench.VARIANTS[variant])
    variables = layer.init(key, x, attention_mask=None, deterministic=False)
    kwargs = {"attention_mask": None, "deterministic": False}
    return make_step(layer.apply, kwargs, rngs={"dropout": dropout_key}), (variables, x, dy)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=["dense", "layer", "quantize"])
    parser.add_argument("variant")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3, help="untraced steps first")
    parser.add_argument("--out", default=None)
    parser.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke run: no GPU events)")
    parser.add_argument("--sweep", default=None, help="NAME=v1,v2,...: trace once per value of env NAME")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    if args.which == "dense" and args.variant.endswith("_unfused"):
        from lowbit.dense import DENSE_BACKWARD_ENV
        os.environ[DENSE_BACKWARD_ENV] = "unfused"  # read when the step is traced
    step, step_args = build(args.which, args.variant, args.small)
    if args.sweep is None:
        return trace(step, step_args, args, args.out or tempfile.mkdtemp(), args.variant)
    name, _, values = args.sweep.partition("=")
    for value in values.split(","):
        if value:
            os.environ[name] = value
        else:
            os.environ.pop(name, None)
        trace(step, step_args, args, tempfile.mkdtemp(), f"{args.variant} {name}={value or '(unset)'}")


def traced_kernels(fn, fn_args, steps: int, out: str):
    """(wall ms per step, {kernel name: [device us per step, launches]}) of `steps` calls of
    fn traced with jax.profiler into `out`."""
    with jax.profiler.trace(out, create_perfetto_trace=True):
        # Timed inside the trace: the profiler's start and its export on exit (tens of ms,
        # which the wall time once included) are not the steps'.
        start = time.perf_counter()
        r = None
        for _ in range(steps):
            r = fn(*fn_args)
        jax.block_until_ready(r)
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    events, _ = common.device_events(out)
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        by_name[e["name"]][0] += e.get("dur", 0.0) / steps
        by_name[e["name"]][1] += 1
    return wall_ms, by_name


def trace(step, step_args, args, out, label):
    r = None
    for _ in range(args.warmup):
        r = step(*step_args)
    jax.block_until_ready(r)
    wall_ms, by_name = traced_kernels(step, step_args, args.steps, out)
    # Streams overlap only where XLA made them; the sum of kernel time is the busy time.
    busy_us = sum(v[0] for v in by_name.values()) or 1.0
    print(f"{args.which} {label}: {args.steps} traced steps, wall {wall_ms:.3f} ms/step (tracing "
          f"adds a little), device busy {busy_us / 1e3:.3f} ms/step")
    print(f"{'us/step':>9s} {'share':>6s} {'calls':>5s}  kernel")
    for name, (us, calls) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{us:9.1f} {100 * us / busy_us:5.1f}% {calls // args.steps:5d}  {name[:110]}")


if __name__ == "__main__":
    main()
