"""Seed transformer layer (batch 4, seq 2048, hidden 4096, ffn 16384, 32 heads; the code of
examples/te_integration_layer.py) forward+backward, side by side in one run: bf16 Flax,
Flax's FP8 (`Fp8DirectDotGeneralOp` in every Dense), lowbit per recipe through the seed's
`dot_general` drop-in (`lowbit_*`), and the same layer built from lowbit's fused modules
(`fused_*`: examples/fused_layer.py, the same params mapped over; `fused_delayed_fast_bwd` with
the backward GEMMs at fast accumulation, not the default numerics; `fused_block_unfused` with
LOWBIT_DENSE_BACKWARD=unfused: its output projection's block backward without token bands). `*_block` is
Float8BlockScaling (1x128 activations and gradients, 128x128 weights) beside the per-tensor
recipes in the same run. Prints time, ratio to bf16
and to Flax's FP8, and the compiled step's peak memory. The variants are timed round-robin
(common.time_steps: an H100 at its power cap runs a step at a speed that depends on how hot
the card is).

    python bench/bench_layer.py            # GPU, seed shape
    python bench/bench_layer.py --small    # CPU smoke run
    python bench/bench_layer.py --variants flax_fp8,fused_delayed --algo fused_dgrad=1
        # each lowbit variant also as <variant>@algo, traced with LOWBIT_GEMM_ALGO=fused_dgrad=1
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from flax import linen as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import common  # noqa: E402
from quickstart_jax_utils import make_step  # noqa: E402
from fused_layer import FusedTransformerLayer, from_flax_params  # noqa: E402
from te_integration_layer import FlaxTransformerLayer  # noqa: E402

import lowbit  # noqa: E402
from lowbit.dense import DENSE_BACKWARD_ENV  # noqa: E402
from lowbit.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling  # noqa: E402

VARIANTS = {
    "bf16": lambda: None,
    "flax_fp8": lambda: nn.Fp8DirectDotGeneralOp(),
    "lowbit_delayed": lowbit.flax.make_dot_general_cls(DelayedScaling()),
    "lowbit_current": lowbit.flax.make_dot_general_cls(Float8CurrentScaling()),
    "lowbit_block": lowbit.flax.make_dot_general_cls(Float8BlockScaling()),
}
FUSED_VARIANTS = {"fused_delayed": DelayedScaling, "fused_current": Float8CurrentScaling,
                  "fused_block": Float8BlockScaling, "fused_block_unfused": Float8BlockScaling,
                  "fused_delayed_fast_bwd": lambda: DelayedScaling(**common.FAST_BWD)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3, help="round-robin rounds (common.time_steps)")
    parser.add_argument("--variants", default=None,
                        help="comma-separated subset of " + ",".join([*VARIANTS, *FUSED_VARIANTS])
                        + " (bf16 always runs: the ratios need it)")
    common.add_algo_argument(parser)
    args = parser.parse_args(argv)
    b, s, h, f, heads = (2, 64, 128, 512, 4) if args.small else (4, 2048, 4096, 16384, 32)
    iters = args.iters or (2 if args.small else 20)
    key, dropout_key = jax.random.split(jax.random.PRNGKey(42))
    x = jax.random.normal(key, (b, s, h)).astype(jnp.bfloat16)
    dy = jax.random.normal(key, (b, s, h)).astype(jnp.bfloat16)
    kwargs = {"attention_mask": None, "deterministic": False}

    chosen = set(args.variants.split(",")) | {"bf16"} if args.variants else None
    unknown = (chosen or set()) - {*VARIANTS, *FUSED_VARIANTS}
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}")
    cases, layers, params = {}, {}, None
    for name, cls in VARIANTS.items():
        if chosen is not None and name not in chosen:
            continue
        layer = FlaxTransformerLayer(hidden_size=h, ffn_hidden_size=f, num_attention_heads=heads,
                                     dot_general_cls=cls)
        variables = layer.init(key, x, attention_mask=None, deterministic=False)
        if params is None:
            params = variables["params"]
        variables = {**variables, "params": params}
        layers[name] = layer
        cases[name] = (make_step(layer.apply, kwargs, rngs={"dropout": dropout_key}), variables, x, dy)
    for name, recipe in FUSED_VARIANTS.items():
        if chosen is not None and name not in chosen:
            continue
        layer = FusedTransformerLayer(hidden_size=h, ffn_hidden_size=f, num_attention_heads=heads,
                                      quantization_recipe=recipe())
        variables = layer.init(key, x, attention_mask=None, deterministic=False)
        variables = {**variables, "params": from_flax_params(params)}
        layers[name] = layer
        step = make_step(layer.apply, kwargs, rngs={"dropout": dropout_key})
        if name.endswith("_unfused"):
            step = common.with_env(step, DENSE_BACKWARD_ENV, "unfused")
        cases[name] = (step, variables, x, dy)
    cases = common.add_algo_twins(
        cases, args.algo, lambda name: make_step(layers[name].apply, kwargs, rngs={"dropout": dropout_key}))
    results = common.time_steps(cases, iters, rounds=1 if args.small else args.rounds)
    for name, r in results.items():
        print(f"{name}: {r['ms']:.3f} ms (rounds: {', '.join(f'{t:.2f}' for t in r['ms_rounds'])})", flush=True)
    common.print_table(common.speedup_table(results), ["variant", "ms", "x bf16", "x flax_fp8", "peak GiB"])
    path = common.write_results("layer" + ("_small" if args.small else ""), {
        "shape": {"batch": b, "seq": s, "hidden": h, "ffn": f, "heads": heads}, "variants": results,
        "algo_twins": args.algo})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
