"""Seed MLP block (layernorm -> Dense(ffn) -> gelu -> Dense(hidden); batch 4, seq 2048, hidden
4096, ffn 16384) forward+backward, side by side in one run: bf16 Flax, Flax's FP8
(`Fp8DirectDotGeneralOp` in both Dense), and lowbit's fused LayerNormMLP per recipe (one
lowbit.layernorm_mlp). Prints time, ratio to bf16 and to Flax's FP8, and the compiled
step's peak memory; writes bench/results/mlp_<device>.json.

    python bench/bench_mlp.py            # GPU, seed shape
    python bench/bench_mlp.py --small    # CPU smoke run
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

import lowbit  # noqa: E402
from lowbit.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402

DTYPE = jnp.bfloat16


class FlaxMLP(nn.Module):
    """The reference block in plain Flax; dot_general_cls None = bf16 GEMMs."""

    ffn: int
    dot_general_cls: object = None

    @nn.compact
    def __call__(self, x):
        hidden = x.shape[-1]
        kw = dict(dtype=DTYPE, param_dtype=DTYPE)
        if self.dot_general_cls is not None:
            kw["dot_general_cls"] = self.dot_general_cls
        h = nn.LayerNorm(epsilon=1e-6, dtype=DTYPE, param_dtype=DTYPE)(x)
        h = nn.Dense(self.ffn, use_bias=False, **kw)(h)
        h = nn.gelu(h, approximate=True)
        return nn.Dense(hidden, use_bias=False, **kw)(h)


class LowbitMLP(nn.Module):
    """lowbit.flax.LayerNormMLP (one fused layernorm_mlp), its output only."""

    ffn: int
    recipe: object

    @nn.compact
    def __call__(self, x):
        out, _ = lowbit.flax.LayerNormMLP(
            intermediate_dim=self.ffn, activations=("gelu",), intermediate_dropout_rate=0.0,
            return_layernorm_output=False, dtype=DTYPE, quantization_recipe=self.recipe)(x, deterministic=True)
        return out


VARIANTS = {
    "bf16": lambda f: FlaxMLP(f),
    "flax_fp8": lambda f: FlaxMLP(f, nn.Fp8DirectDotGeneralOp),
    "lowbit_delayed": lambda f: LowbitMLP(f, DelayedScaling()),
    "lowbit_current": lambda f: LowbitMLP(f, Float8CurrentScaling()),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--iters", type=int, default=None)
    args = parser.parse_args(argv)
    b, s, h, f = (2, 64, 128, 512) if args.small else (4, 2048, 4096, 16384)
    iters = args.iters or (2 if args.small else 20)
    key = jax.random.PRNGKey(42)
    kx, kd = jax.random.split(key)
    x = jax.random.normal(kx, (b, s, h)).astype(DTYPE)
    dy = jax.random.normal(kd, (b, s, h)).astype(DTYPE)

    results = {}
    for name, make in VARIANTS.items():
        model = make(f)
        results[name] = common.time_step(make_step(model.apply, {}), model.init(key, x), x, dy, iters)
        print(f"{name}: {results[name]['ms']:.3f} ms", flush=True)
    common.print_table(common.speedup_table(results), ["variant", "ms", "x bf16", "x flax_fp8", "peak GiB"])
    path = common.write_results("mlp" + ("_small" if args.small else ""), {
        "shape": {"batch": b, "seq": s, "hidden": h, "ffn": f, "activation": "gelu"}, "variants": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
