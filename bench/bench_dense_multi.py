"""Seed Dense tutorial, multi-GPU section: one nn.Dense (x 8x2048x8192 bf16 -> 32768 features)
forward+backward on a (dp, tp) mesh: DP=2/TP=2 on 4 devices (column-parallel kernel
P(None, 'tp'), x P('dp'), dy P('dp', None, 'tp')) and DP=2 on 2 devices, bf16 against
Flax's FP8 (`Fp8DirectDotGeneralOp`) and lowbit's Float8CurrentScaling and DelayedScaling in
the same run (round-robin, common.time_steps), with speedups over bf16 and Flax's FP8 and
the compiled step's peak memory per device. `lowbit_delayed_psum_fp32`: DelayedScaling with
LOWBIT_GEMM_PSUM=fp32 (the row-parallel / data-parallel partial sums in fp32);
`lowbit_delayed_fused`: with LOWBIT_DENSE_BACKWARD=fused_sharded (dense's fused backward on
each device's blocks). 6 variants x 2 configs x 3 rounds take ~5 minutes on 4 H200s.
Configurations needing more devices than jax.devices() offers are skipped (printed).

    python bench/bench_dense_multi.py            # GPUs, seed shape
    python bench/bench_dense_multi.py --small    # CPU smoke run on 4 virtual devices
    python bench/bench_dense_multi.py --variants lowbit_delayed,lowbit_delayed_fused
        (a subset; bf16 and flax_fp8 always run: the ratios need them)
"""

from __future__ import annotations

import argparse
import os
import sys

if "--small" in sys.argv and "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import linen as nn  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import common  # noqa: E402
from quickstart_jax_utils import make_step  # noqa: E402

import lowbit  # noqa: E402
from lowbit.dense import DENSE_BACKWARD_ENV  # noqa: E402
from lowbit.ops.gemm import PSUM_ENV  # noqa: E402
from lowbit.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402
from lowbit.sharding import MeshResource, global_shard_guard  # noqa: E402

CONFIGS = {"dp2_tp2": (2, 2), "dp2": (2, 1)}  # name -> (dp, tp)


class DenseBlock(nn.Module):
    features: int
    dot_general_cls: object = None

    @nn.compact
    def __call__(self, x):
        dg = self.dot_general_cls() if self.dot_general_cls else None
        return nn.Dense(self.features, use_bias=True, dtype=x.dtype, dot_general=dg)(x)


def variants():
    """name -> (model for `features`, the env knob it is traced under or None)."""
    delayed = lambda f: DenseBlock(f, lowbit.flax.make_dot_general_cls(DelayedScaling()))  # noqa: E731
    return {
        "bf16": (lambda f: DenseBlock(f), None),
        "flax_fp8": (lambda f: DenseBlock(f, nn.Fp8DirectDotGeneralOp), None),
        "lowbit_current": (lambda f: DenseBlock(f, lowbit.flax.make_dot_general_cls(Float8CurrentScaling())), None),
        "lowbit_delayed": (delayed, None),
        # the K-sharded GEMMs' partial products summed in fp32 (twice the all-reduce bytes)
        "lowbit_delayed_psum_fp32": (delayed, (PSUM_ENV, "fp32")),
        # dense's fused backward under the mesh (opt-in) instead of the separate ops
        "lowbit_delayed_fused": (delayed, (DENSE_BACKWARD_ENV, "fused_sharded")),
    }


def shard_variables(variables, mesh):
    """Column-parallel kernel (H, F@tp) and bias (F@tp); delayed-scaling state replicated."""
    def spec(path, leaf):
        names = [getattr(k, "key", "") for k in path]
        if names[0] == "params" and names[-1] == "kernel":
            return NamedSharding(mesh, P(None, "tp"))
        if names[0] == "params" and names[-1] == "bias":
            return NamedSharding(mesh, P("tp"))
        return NamedSharding(mesh, P())
    return jax.device_put(variables, jax.tree_util.tree_map_with_path(spec, variables))


def run_config(name, dp, tp, shape, iters, rounds, chosen=None):
    b, s, h, f = shape
    devices = jax.devices()[: dp * tp]
    mesh = Mesh(np.array(devices).reshape(dp, tp), ("dp", "tp"))
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (b, s, h), jnp.bfloat16)
    dy = jax.random.normal(jax.random.PRNGKey(1), (b, s, f), jnp.bfloat16)
    x = jax.device_put(x, NamedSharding(mesh, P("dp", None, None)))
    dy = jax.device_put(dy, NamedSharding(mesh, P("dp", None, "tp")))
    flops = 3 * 2 * b * s * h * f
    cases, params = {}, None
    with global_shard_guard(MeshResource(dp_resource="dp", tp_resource="tp")):
        for variant, (make, env) in variants().items():
            if chosen is not None and variant not in chosen:
                continue
            model = make(f)
            variables = jax.jit(model.init)(key, x)
            params = variables["params"] if params is None else params  # same weights for all
            variables = shard_variables({**variables, "params": params}, mesh)
            step = make_step(model.apply, {})
            cases[variant] = (common.with_env(step, *env) if env else step, variables, x, dy)
        results = common.time_steps(cases, iters, rounds)  # round-robin (power cap)
    for r in results.values():
        r["tflops_per_device"] = flops / (r["ms"] * 1e-3) / 1e12 / (dp * tp)
        r["speedup_vs_bf16"] = results["bf16"]["ms"] / r["ms"]
        r["speedup_vs_flax_fp8"] = results["flax_fp8"]["ms"] / r["ms"]
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="CPU-sized shapes")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3, help="round-robin rounds (common.time_steps)")
    parser.add_argument("--variants", default=None, help="comma-separated subset of " + ",".join(variants())
                        + " (bf16 and flax_fp8 always run)")
    args = parser.parse_args(argv)
    chosen = None
    if args.variants:
        chosen = set(args.variants.split(",")) | {"bf16", "flax_fp8"}
        if chosen - set(variants()):
            parser.error(f"--variants: unknown {sorted(chosen - set(variants()))}")
    shape = (4, 32, 128, 256) if args.small else (8, 2048, 8192, 32768)
    iters = args.iters or (2 if args.small else 20)
    n = len(jax.devices())
    rows, payload = [], {"shape": dict(zip(("batch", "seq", "hidden", "features"), shape)),
                         "devices": n, "configs": {}}
    for name, (dp, tp) in CONFIGS.items():
        if dp * tp > n:
            print(f"skipping {name}: needs {dp * tp} devices, jax.devices() has {n}")
            continue
        results = run_config(name, dp, tp, shape, iters, 1 if args.small else args.rounds, chosen)
        payload["configs"][name] = results
        for variant, r in results.items():
            rows.append({"config": name, "variant": variant, "ms": r["ms"],
                         "TFLOP/s/dev": r["tflops_per_device"], "x bf16": r["speedup_vs_bf16"],
                         "x flax_fp8": r["speedup_vs_flax_fp8"],
                         "peak GiB/dev": (r["peak_bytes"] or 0) / 2**30})
    if not rows:  # keep the last multi-GPU results rather than overwrite them with nothing
        print("no configuration fits this machine's devices; nothing written")
        return
    common.print_table(rows, ["config", "variant", "ms", "TFLOP/s/dev", "x bf16", "x flax_fp8",
                             "peak GiB/dev"])
    path = common.write_results("dense_multi" + ("_small" if args.small else ""), payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
