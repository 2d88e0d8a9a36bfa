"""The seed tutorial "JAX: Dense GEMMs with TransformerEngine", on lowbit.

A plain `flax.linen.Dense` block whose GEMM is swapped for lowbit's quantized one by passing
`dot_general=te_dot_general_cls()`; only the imports differ from the tutorial (main adds one
closing check: the quantized block's output against bf16's, same weights). Runs at the
tutorial's shape (8 x 2048 x 8192 -> 32768) on a GPU, or smaller anywhere:

    python examples/dense_tutorial.py --recipe Float8CurrentScaling
    python examples/dense_tutorial.py --small --recipe DelayedScaling
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from flax import linen as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quickstart_jax_utils as utils  # noqa: E402
from lowbit import flax as te_flax  # noqa: E402
from lowbit.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling  # noqa: E402,F401


class FlaxDenseBlock(nn.Module):
    """One large Dense layer; `dot_general_cls` lets us swap the GEMM implementation."""
    features: int
    dot_general_cls: callable = lambda: None

    @nn.compact
    def __call__(self, x):
        return nn.Dense(features=self.features, use_bias=True, dtype=x.dtype,
                        dot_general=self.dot_general_cls())(x)


SEED_SHAPE = dict(batch=8, seq=2048, hidden=8192, features=32768)
SMALL_SHAPE = dict(batch=2, seq=64, hidden=256, features=512)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="Float8CurrentScaling",
                        choices=["DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling",
                                 "NVFP4BlockScaling"])
    parser.add_argument("--small", action="store_true", help="CPU-sized shapes")
    parser.add_argument("--iters", type=int, default=None)
    args = parser.parse_args(argv)
    shape = SMALL_SHAPE if args.small else SEED_SHAPE
    iters = args.iters or (3 if args.small else 50)

    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (shape["batch"], shape["seq"], shape["hidden"]), jnp.bfloat16)
    dy = jax.random.normal(key, (shape["batch"], shape["seq"], shape["features"]), jnp.bfloat16)

    baseline = FlaxDenseBlock(features=shape["features"])
    params = baseline.init(key, x)
    print("bf16 Flax Dense:")
    base_ms = utils.speedometer(baseline.apply, params, x, dy, timing_iters=iters, warmup_iters=min(iters, 5))

    quantization_recipe = globals()[args.recipe]()
    te_dot_general_cls = te_flax.make_dot_general_cls(quantization_recipe)
    quantized = FlaxDenseBlock(features=shape["features"], dot_general_cls=te_dot_general_cls)
    var_collect = quantized.init(key, x)
    var_collect = {**var_collect, "params": params["params"]}  # same weights as the baseline
    rngs = {"sr_rng": jax.random.PRNGKey(1)} if isinstance(quantization_recipe, NVFP4BlockScaling) else None
    print(f"lowbit {args.recipe}:")
    q_ms = utils.speedometer(quantized.apply, var_collect, x, dy, timing_iters=iters,
                             warmup_iters=min(iters, 5), rngs=rngs)
    print(f"speedup over bf16: {base_ms / q_ms:.2f}x")
    # Not in the tutorial: how far the quantized block's output is from bf16's, same weights.
    y_base = baseline.apply(params, x).astype(jnp.float32)
    y_q = quantized.apply(var_collect, x, rngs=rngs).astype(jnp.float32)
    rel = float(jnp.linalg.norm(y_q - y_base) / jnp.linalg.norm(y_base))
    print(f"output vs bf16: relative difference {rel:.4f}")
    return {"bf16_ms": base_ms, "lowbit_ms": q_ms, "rel_diff": rel}


if __name__ == "__main__":
    main()
