"""examples/fused_layer.py: the seed layer built from lowbit's fused modules computes the seed's
FlaxTransformerLayer (examples/te_integration_layer.py) from the same params.

Tolerances: unquantized, the fused path rounds the norm output and the MLP intermediate to
bf16 (x's dtype) where the Flax layer keeps fp32, so outputs agree to a few bf16 ulps of
|y| (<= 2^-6 max|y|, measured ~2^-9). With an FP8 recipe, E4M3 rounding of every GEMM input
(2^-4 relative per element) gives a relative error of a few percent in the output norm; the
bound 0.08 is about twice what this shape shows (0.037); gradients, through E5M2 output
gradients, get 0.15 (measured 0.028-0.063 per parameter, 0.075 for the input). The block
recipes (Float8BlockScaling, MXFP8BlockScaling: E4M3 data with 1x128 / 128x128 or 32-value
scales, emulated exactly on the CPU) keep the same bounds: measured 0.037 for the output, 0.061
for the input gradient and 0.027-0.053 per parameter. The layer's LayerNorm scales and all its
biases are random (Flax initialises them to 1 and 0, which a path that dropped them would pass).
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from fused_layer import FusedTransformerLayer, from_flax_params  # noqa: E402
from te_integration_layer import FlaxTransformerLayer  # noqa: E402

from lowbit.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling  # noqa: E402

SHAPE = dict(hidden_size=128, ffn_hidden_size=384, num_attention_heads=4)


@pytest.fixture(scope="module")
def flax_layer():
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 48, SHAPE["hidden_size"])).astype(jnp.bfloat16)
    layer = FlaxTransformerLayer(**SHAPE)
    params = _randomize_norms_and_biases(layer.init(jax.random.PRNGKey(4), x, deterministic=True)["params"])
    y = layer.apply({"params": params}, x, deterministic=True)
    return x, params, y


def _randomize_norms_and_biases(params):
    """Flax initialises LayerNorm scales to 1 and every bias to 0, which a path that dropped
    them would pass: random scales around 1 and random biases instead."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.PRNGKey(5), len(leaves))
    out = []
    for (path, leaf), key in zip(leaves, keys):
        name = jax.tree_util.keystr(path)
        noise = jax.random.normal(key, leaf.shape, leaf.dtype)
        if name.endswith("['scale']"):
            leaf = 1 + 0.3 * noise
        elif name.endswith("['bias']"):
            leaf = 0.3 * noise
        out.append(leaf)
    return jax.tree_util.tree_unflatten(tree, out)


def _rel(a, b):
    return float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))


def test_unquantized_equals_flax_layer(flax_layer):
    x, params, y = flax_layer
    fused = FusedTransformerLayer(**SHAPE)
    yf = fused.apply({"params": from_flax_params(params)}, x, deterministic=True)
    assert yf.dtype == y.dtype == jnp.float32 and yf.shape == y.shape
    assert float(jnp.max(jnp.abs(yf - y))) <= 2.0**-6 * float(jnp.max(jnp.abs(y)))


@pytest.mark.parametrize("recipe", [DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling])
def test_quantized_close_to_flax_layer_with_gradients(flax_layer, recipe):
    x, params, y = flax_layer
    fused = FusedTransformerLayer(**SHAPE, quantization_recipe=recipe())
    variables = fused.init(jax.random.PRNGKey(4), x, deterministic=True)
    variables = {**variables, "params": from_flax_params(params)}
    yq = fused.apply(variables, x, deterministic=True)
    assert _rel(yq, y) < 0.08

    def loss(p, inp):
        return jnp.sum(fused.apply({**variables, "params": p}, inp, deterministic=True) ** 2)

    g_params, g_x = jax.grad(loss, argnums=(0, 1))(variables["params"], x)
    ref_params, ref_x = jax.grad(
        lambda p, inp: jnp.sum(FlaxTransformerLayer(**SHAPE).apply({"params": p}, inp, deterministic=True) ** 2),
        argnums=(0, 1))(params, x)
    assert _rel(g_x, ref_x) < 0.15
    ref_mapped = from_flax_params(ref_params)
    for name in ("ln_qkv", "proj", "ln_mlp"):
        for leaf in ref_mapped[name]:
            got = jnp.asarray(g_params[name][leaf])
            assert np.all(np.isfinite(np.asarray(got))), (name, leaf)
            assert _rel(got, ref_mapped[name][leaf]) < 0.15, (name, leaf)
