"""The seed tutorials (examples/te_integration_layer.py, examples/dense_tutorial.py) run on
lowbit with only their imports changed: at small shapes here, at the seed shapes on a GPU
(tools/gpu_check.sh runs the scripts). Outputs are compared with the unquantized model with
the same parameters; FP8 (E4M3) error allows 8% of the output's RMS for the layer's
quantized part (the residual path is exact), NVFP4 (E2M1 values, 16-value blocks) 35%: one
of its GEMMs lands ~14% off, the tutorial's MLP (two GEMMs and a GELU) 0.21, the layer (four
GEMMs, the attention's softmax on quantized logits) 0.24-0.25, measured over seeds. NVFP4's stochastic rounding and RHT signs take their key from the Flax RNG
stream "sr_rng" (apply(..., rngs={"sr_rng": key})), as the tutorial scripts pass it."""

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

from conftest import rel_err  # noqa: E402

import lowbit  # noqa: E402
from lowbit.recipe import (  # noqa: E402
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

RECIPES = [DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling]
pytestmark = pytest.mark.filterwarnings("ignore:lowbit.ops.gemm. NVFP4")  # the emulation notice



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
    err = rel_err(y_quant - x, y_base - x)
    assert 0 < err < (0.35 if recipe is NVFP4BlockScaling else 0.08)


def test_nvfp4_dot_general_takes_its_key_from_the_sr_rng_stream():
    """make_dot_general_cls(NVFP4BlockScaling()): the gradients' stochastic rounding draws from
    apply(..., rngs={"sr_rng": key}): the same key gives the same gradients, another key other
    ones, no stream a clear error naming it; the gradients stay within NVFP4 error of bf16's."""
    mlp = tut.FlaxMLP(hidden_size=64, ffn_hidden_size=128,
                      dot_general_cls=lowbit.flax.make_dot_general_cls(NVFP4BlockScaling()))
    base = tut.FlaxMLP(hidden_size=64, ffn_hidden_size=128)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 64), jnp.float32)
    dy = jax.random.normal(jax.random.PRNGKey(1), (2, 16, 64), jnp.float32)
    variables = base.init(jax.random.PRNGKey(2), x)

    def grads(step):  # the kernels' and x's (the last bias's is sum(dy), exact with any key)
        _, _, var_grads, x_grad = step(variables, x, dy)
        params = var_grads["params"]
        return [params["Dense_0"]["kernel"], params["Dense_1"]["kernel"], params["Dense_0"]["bias"], x_grad]

    make_step = quickstart_jax_utils.make_step
    got = [grads(make_step(mlp.apply, {}, rngs={"sr_rng": jax.random.PRNGKey(k)})) for k in (7, 7, 8)]
    want = grads(make_step(base.apply, {}))
    for a, a_again, b, w in zip(*got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(a_again))
        assert not np.array_equal(np.asarray(a), np.asarray(b))
        assert 0 < rel_err(a, w) < 0.35
    with pytest.raises(ValueError, match="sr_rng"):
        quickstart_jax_utils.make_step(mlp.apply, {})(variables, x, dy)


# The scripts' quantized outputs against their unquantized twins (same params), small shapes:
# measured 0.035-0.038 for the FP8 recipes, 0.138-0.144 for NVFP4 (E2M1 data).
SCRIPT_BOUNDS = {"DelayedScaling": 0.08, "Float8CurrentScaling": 0.08, "NVFP4BlockScaling": 0.25}


@pytest.mark.parametrize("recipe", list(SCRIPT_BOUNDS))
def test_layer_tutorial_script_runs(recipe, capsys):
    result = tut.main(["--small", "--recipe", recipe, "--iters", "2"])
    out = capsys.readouterr().out
    assert "Mean time:" in out and result["mean_ms"] > 0
    assert 0 < result["rel_diff"] < SCRIPT_BOUNDS[recipe]
    if recipe == "DelayedScaling":
        assert "_overwrite_with_gradient" in out and "TEWrapper_dot_general_0" in out
        assert "_overwrite_with_gradient" in result["variables"]


@pytest.mark.parametrize("recipe", list(SCRIPT_BOUNDS))
def test_dense_tutorial_script_runs(recipe, capsys):
    result = dense_tutorial.main(["--small", "--recipe", recipe, "--iters", "2"])
    assert "speedup over bf16" in capsys.readouterr().out
    assert result["bf16_ms"] > 0 and result["lowbit_ms"] > 0
    assert 0 < result["rel_diff"] < SCRIPT_BOUNDS[recipe]


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
