"""The seed tutorials (examples/te_integration_layer.py, examples/dense_tutorial.py) run on
lowbit with only their imports changed: at small shapes here, at the seed shapes on a GPU
(tools/gpu_check.sh runs the scripts). Outputs are compared with the unquantized model with
the same parameters; FP8 (E4M3) error allows 8% of the output's RMS for the layer's
quantized part (the residual path is exact)."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import dense_tutorial  # noqa: E402
import quickstart_jax_utils  # noqa: E402
import te_integration_layer as tut  # noqa: E402

import lowbit  # noqa: E402
from lowbit.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling  # noqa: E402

RECIPES = [DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling]


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def small_layer(dot_general_cls=lambda: None):
    return tut.FlaxTransformerLayer(hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                                    dot_general_cls=dot_general_cls)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.__name__)
def test_layer_tutorial_close_to_unquantized(recipe):
    key = jax.random.PRNGKey(42)
    x = jax.random.normal(key, (2, 32, 128)).astype(jnp.bfloat16)
    base = small_layer()
    params = base.init(key, x, attention_mask=None, deterministic=True)
    quant = small_layer(lowbit.flax.make_dot_general_cls(recipe()))
    variables = quant.init(key, x, attention_mask=None, deterministic=True)
    variables = {**variables, "params": params["params"]}
    y_base = base.apply(params, x, attention_mask=None, deterministic=True)
    if recipe is DelayedScaling:
        # Scales start at 1: run one fwd+bwd step so they come from real amaxes.
        step = quickstart_jax_utils.make_step(quant.apply, {"attention_mask": None, "deterministic": True})
        new_vars, *_ = step(variables, x, jnp.ones_like(y_base))
        before = variables["_overwrite_with_gradient"]
        after = new_vars["_overwrite_with_gradient"]
        changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), before, after)
        assert all(jax.tree.leaves(changed))
        variables = new_vars
    y_quant = quant.apply(variables, x, attention_mask=None, deterministic=True)
    assert y_quant.shape == y_base.shape
    # Compare the layer's update (y - x): the residual x itself is exact.
    assert rel_err(y_quant - x, y_base - x) < 0.08


@pytest.mark.parametrize("recipe", ["DelayedScaling", "Float8CurrentScaling"])
def test_layer_tutorial_script_runs(recipe, capsys):
    tut.main(["--small", "--recipe", recipe, "--iters", "2"])
    out = capsys.readouterr().out
    assert "Mean time:" in out
    if recipe == "DelayedScaling":
        assert "_overwrite_with_gradient" in out and "Wrapper_dot_general_0" in out


@pytest.mark.parametrize("recipe", ["DelayedScaling", "Float8CurrentScaling"])
def test_dense_tutorial_script_runs(recipe, capsys):
    dense_tutorial.main(["--small", "--recipe", recipe, "--iters", "2"])
    assert "speedup over bf16" in capsys.readouterr().out


def test_compiled_mlp_uses_lowbit_gemms_only():
    """In the compiled fwd+bwd of the tutorial's MLP, every GEMM is lowbit's custom call
    (3 per Dense) and no dot is left in their place."""
    mlp = tut.FlaxMLP(hidden_size=64, ffn_hidden_size=128,
                      dot_general_cls=lowbit.flax.make_dot_general_cls(Float8CurrentScaling()))
    x = jnp.ones((2, 16, 64), jnp.bfloat16)
    variables = mlp.init(jax.random.PRNGKey(0), x)
    step = quickstart_jax_utils.make_step(mlp.apply, {})
    hlo = step.lower(variables, x, jnp.ones((2, 16, 64), jnp.bfloat16)).compile().as_text()
    assert hlo.count('custom_call_target="lowbit_gemm"') == 6
    assert " dot(" not in hlo
