"""lowbit.flax.nnx twins against the Linen modules with the same parameters and state.

The two front ends share their math (lowbit/flax/_common.py), so with the same parameters
(and, for DelayedScaling, the same state) the outputs are equal bit for bit; the NNX
training step (nnx.grad over Param + QuantizerState, update_quantizer_state) is checked
against the Linen overwrite-with-gradient step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import lowbit
from lowbit.flax import OVERWRITE_WITH_GRADIENT, module as linen
from lowbit.flax import nnx as lnnx
from lowbit.quantize import QuantizerFactory
from lowbit.recipe import DelayedScaling, Float8CurrentScaling

B, T, H, F = 2, 8, 32, 64
OWG = OVERWRITE_WITH_GRADIENT


def x_in(seed=0, shape=(B, T, H)):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def call(mod, x, **kw):
    """mod(x) under nnx.jit (one compile instead of one per op: faster on the CPU)."""
    return nnx.jit(lambda m, x: m(x, **kw))(mod, x)


def out0(y):
    return y[0] if isinstance(y, tuple) else y


def pair(name, recipe=None):
    """(Linen module, NNX module) with the same configuration."""
    rngs = nnx.Rngs(0)
    if name == "dense":
        return (linen.DenseGeneral((4, 8), use_bias=True, quantization_recipe=recipe),
                lnnx.DenseGeneral(H, (4, 8), use_bias=True, quantization_recipe=recipe, rngs=rngs))
    if name == "layernorm":
        return linen.LayerNorm(layernorm_type="rmsnorm"), lnnx.LayerNorm(H, layernorm_type="rmsnorm", rngs=rngs)
    if name == "ln_dense":
        kw = dict(use_bias=True, enable_low_rank_adaptation=True, low_rank_adaptation_dim=4,
                  low_rank_adaptation_alpha=8.0, quantization_recipe=recipe)
        return linen.LayerNormDenseGeneral(24, **kw), lnnx.LayerNormDenseGeneral(H, 24, **kw, rngs=rngs)
    kw = dict(activations=("relu",), use_bias=True, return_layernorm_output=False,
              intermediate_dropout_rate=0.0, quantization_recipe=recipe)
    return linen.LayerNormMLP(F, **kw), lnnx.LayerNormMLP(H, F, **kw, rngs=rngs)


def load_linen_into_nnx(nnx_module, variables):
    """Copies Linen params and quantizer state into the NNX module (same names)."""
    for collection in ("params", OWG):
        for name, value in variables.get(collection, {}).items():
            getattr(nnx_module, name)[...] = value


def linen_vars(module, x):
    v = nn.meta.unbox(module.init(jax.random.PRNGKey(1), x))
    # Random LoRA b, norm scales and biases (0, 1 and 0 at init) so that they are exercised:
    # a twin that dropped one would otherwise compute the same output.
    def randomize(p, a):
        name = jax.tree_util.keystr(p)
        if not name.startswith("['params']"):
            return a
        if "lora_b" in name:
            return x_in(5, a.shape) * 0.1
        if name.endswith("scale']"):
            return 1 + 0.3 * x_in(6, a.shape)
        if name.endswith("bias']"):
            return 0.3 * x_in(7, a.shape)
        return a
    return jax.tree_util.tree_map_with_path(randomize, v)


@pytest.mark.parametrize("name", ["dense", "layernorm", "ln_dense", "mlp"])
def test_same_params_same_output(name):
    lin, mod = pair(name)
    x = x_in()
    v = linen_vars(lin, x)
    load_linen_into_nnx(mod, v)
    ya, yb = jax.jit(lin.apply)(v, x), call(mod, x)
    jax.tree.map(np.testing.assert_array_equal, ya, yb)


@pytest.mark.parametrize("name", ["dense", "ln_dense", "mlp"])
def test_parameter_names_shapes_and_axes_match_linen(name):
    lin, mod = pair(name)
    x = x_in()
    shapes = jax.tree.map(jnp.shape, linen_vars(lin, x)["params"])
    nnx_params = nnx.state(mod, nnx.Param)
    assert {k[0]: v.shape for k, v in nnx.to_flat_state(nnx_params)} == shapes
    linen_specs = nn.get_partition_spec(lin.init(jax.random.PRNGKey(1), x))["params"]
    nnx_specs = nnx.get_partition_spec(nnx_params)
    for k, spec in linen_specs.items():
        assert tuple(nnx_specs[k].get_value()) == tuple(spec), k


@pytest.mark.parametrize("name", ["dense", "ln_dense", "mlp"])
def test_delayed_scaling_training_step_matches_linen(name):
    recipe = DelayedScaling(amax_history_len=4)
    lin, mod = pair(name, recipe)
    x = x_in()
    v = linen_vars(lin, x)
    load_linen_into_nnx(mod, v)
    lin_grads = jax.jit(jax.grad(lambda v: jnp.sum(out0(lin.apply(v, x)) ** 2)))(v)
    diff = nnx.DiffState(0, nnx.Any(nnx.Param, lnnx.QuantizerState))
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(out0(m(x)) ** 2), argnums=diff))(mod)
    param_grads = lnnx.update_quantizer_state(mod, grads)
    for k, g in lin_grads["params"].items():
        np.testing.assert_allclose(param_grads[k].get_value(), g, rtol=1e-6, atol=1e-6)
    for k, s in lin_grads[OWG].items():  # the new state, written into the NNX module
        np.testing.assert_array_equal(getattr(mod, k)[...], s)
    assert float(mod.x_scale[...][0] if name != "mlp" else mod.x_0_scale[...][0]) != 1.0
    v1 = {**v, OWG: lin_grads[OWG]}
    jax.tree.map(np.testing.assert_array_equal, jax.jit(lin.apply)(v1, x), call(mod, x))


@pytest.mark.parametrize("name", ["ln_dense", "mlp"])
def test_axis_and_te_hint_arguments_as_linen(name):
    """The NNX twins take Linen's (TE's) `axis` (-1 only, an error naming the module and the
    argument otherwise) and LayerNormMLP's dot_1_input_axes / dot_2_input_axes."""
    extra = dict(dot_1_input_axes=("batch", "length", "embed"), dot_2_input_axes=("batch", "length", "mlp"))
    rngs = nnx.Rngs(0)
    if name == "ln_dense":
        good = lnnx.LayerNormDenseGeneral(H, 24, axis=-1, rngs=rngs)
        bad = lnnx.LayerNormDenseGeneral(H, 24, axis=0, rngs=rngs)
        lin_bad, label = linen.LayerNormDenseGeneral(24, axis=0), "LayerNormDenseGeneral"
    else:
        kw = dict(intermediate_dropout_rate=0.0, **extra)
        good = lnnx.LayerNormMLP(H, F, axis=2, **kw, rngs=rngs)
        bad = lnnx.LayerNormMLP(H, F, axis=(0,), **kw, rngs=rngs)
        lin_bad, label = linen.LayerNormMLP(F, axis=0, intermediate_dropout_rate=0.0, **extra), "LayerNormMLP"
    x = x_in()
    assert out0(call(good, x)).shape == (B, T, 24 if name == "ln_dense" else H)
    with pytest.raises(ValueError, match=rf"lowbit.flax.nnx.{label}: axis: only -1 is supported"):
        call(bad, x)
    with pytest.raises(ValueError, match=rf"lowbit.flax.{label}: axis: only -1 is supported"):
        lin_bad.init(jax.random.PRNGKey(0), x)


def test_optimizer_leaves_quantizer_state_alone():
    _, mod = pair("mlp", DelayedScaling(amax_history_len=4))
    x = x_in()
    opt = nnx.Optimizer(mod, optax.sgd(0.1), wrt=nnx.Param)
    diff = nnx.DiffState(0, nnx.Any(nnx.Param, lnnx.QuantizerState))

    @nnx.jit
    def step(model, optimizer, x):
        grads = nnx.grad(lambda m: jnp.mean(m(x)[0] ** 2), argnums=diff)(model)
        optimizer.update(model, lnnx.update_quantizer_state(model, grads))

    wo = np.asarray(mod.wo_kernel[...])
    step(mod, opt, x)
    history1 = np.asarray(mod.grad_1_amax_history[...])
    step(mod, opt, x)
    assert not np.array_equal(wo, mod.wo_kernel[...])
    assert np.count_nonzero(history1) == 1 and np.count_nonzero(mod.grad_1_amax_history[...]) == 2


def test_autocast_at_construction_and_call():
    x = x_in()
    with lowbit.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
        mod = lnnx.DenseGeneral(H, 8, rngs=nnx.Rngs(0))
        y = mod(x)
    assert mod.x_amax_history[...].shape == (4,)
    plain = lnnx.DenseGeneral(H, 8, rngs=nnx.Rngs(0))
    with lowbit.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
        with pytest.raises(ValueError, match="DelayedScaling needs its state"):
            plain(x)
    with lowbit.autocast(enabled=True, recipe=Float8CurrentScaling()):
        y_current = plain(x)
    assert np.linalg.norm(y_current - plain(x)) / np.linalg.norm(plain(x)) < 0.08
    assert y.shape == (B, T, 8)


def test_dropout_uses_its_rng_stream():
    mod = lnnx.LayerNormMLP(H, F, intermediate_dropout_rate=0.5, return_layernorm_output=False,
                            rngs=nnx.Rngs(params=0, dropout=1))
    x = x_in()
    a, b = mod(x)[0], mod(x)[0]
    assert not np.allclose(a, b)
    np.testing.assert_array_equal(mod(x, deterministic=True)[0], mod(x, deterministic=True)[0])


def test_softmax_twin():
    logits = x_in(0, (1, 2, 8, 8))
    np.testing.assert_array_equal(
        lnnx.Softmax(0.5, "scaled_upper_triang")(logits),
        linen.Softmax(0.5, "scaled_upper_triang").apply({}, logits))


# ---------------------------------------------------------------- NVFP4: the SR key

def _nvfp4_dense(rngs):
    import warnings

    from lowbit.recipe import NVFP4BlockScaling

    warnings.filterwarnings("ignore", message="lowbit.ops.gemm: NVFP4")  # the one-time emulation notice
    return lnnx.DenseGeneral(H, 24, quantization_recipe=NVFP4BlockScaling(), rngs=rngs)


def test_nvfp4_key_from_the_call_equals_dense_with_that_key():
    model = _nvfp4_dense(nnx.Rngs(0, sr_rng=1))
    x, key = x_in(3), jax.random.PRNGKey(7)
    qs = QuantizerFactory.create_set(model.active_recipe())
    kernel, bias = model.kernel[...], model.bias[...]
    grad = nnx.grad(lambda m, x: jnp.sum(m(x, sr_key=key) ** 2))(model, x)
    want = jax.grad(lambda k: jnp.sum(lowbit.dense(x, k, bias, ((2,), (0,)), qs, sr_key=key) ** 2))(kernel)
    np.testing.assert_array_equal(np.asarray(grad["kernel"][...]), np.asarray(want))


def test_nvfp4_key_from_the_sr_rng_stream_is_fresh_per_call():
    model = _nvfp4_dense(nnx.Rngs(0, sr_rng=1))
    x = x_in(4)
    loss = lambda m, x: jnp.sum(m(x) ** 2)  # noqa: E731
    g0, g1 = nnx.grad(loss)(model, x), nnx.grad(loss)(model, x)
    assert not np.array_equal(np.asarray(g0["kernel"][...]), np.asarray(g1["kernel"][...]))
    # A model rebuilt from the same seeds repeats the first step's rounding.
    again = nnx.grad(loss)(_nvfp4_dense(nnx.Rngs(0, sr_rng=1)), x)
    np.testing.assert_array_equal(np.asarray(g0["kernel"][...]), np.asarray(again["kernel"][...]))


def test_nvfp4_without_a_key_runs_forward_and_names_the_stream_in_backward():
    model = _nvfp4_dense(nnx.Rngs(0))
    x = x_in(5)
    assert model(x).shape == (B, T, 24)
    with pytest.raises(ValueError, match="sr_rng"):
        nnx.grad(lambda m, x: jnp.sum(m(x) ** 2))(model, x)


def test_nvfp4_layernorm_mlp_takes_two_keys_from_one():
    from lowbit.recipe import NVFP4BlockScaling

    model = lnnx.LayerNormMLP(H, F, quantization_recipe=NVFP4BlockScaling(), rngs=nnx.Rngs(0))
    x, key = x_in(6), jax.random.PRNGKey(8)
    loss = lambda m, x, k: jnp.sum(out0(m(x, deterministic=True, sr_key=k)) ** 2)  # noqa: E731 (no dropout)
    g0, g0_again = nnx.grad(loss)(model, x, key), nnx.grad(loss)(model, x, key)
    g1 = nnx.grad(loss)(model, x, jax.random.PRNGKey(9))
    np.testing.assert_array_equal(np.asarray(g0["wi_kernel"][...]), np.asarray(g0_again["wi_kernel"][...]))
    assert not np.array_equal(np.asarray(g0["wi_kernel"][...]), np.asarray(g1["wi_kernel"][...]))


def test_nvfp4_layernorm_mlp_keys_equal_the_functional_ones():
    """NNX LayerNormMLP(sr_key=key) keys its two GEMMs as lowbit.layernorm_mlp(sr_key=key) does
    (with_sr_key(set_i, fold_in(key, i)): SR keys per quantizer, one RHT sign key per GEMM)."""
    from lowbit.recipe import NVFP4BlockScaling

    recipe = NVFP4BlockScaling()
    model = lnnx.LayerNormMLP(H, F, quantization_recipe=recipe, rngs=nnx.Rngs(0))  # TE's defaults: gelu, no ln output
    x, key = x_in(7), jax.random.PRNGKey(10)
    qs = (QuantizerFactory.create_set(recipe), QuantizerFactory.create_set(recipe))
    got = nnx.grad(lambda m: jnp.sum(out0(m(x, deterministic=True, sr_key=key)) ** 2))(model)
    scale, ln_bias = model.scale[...], model.ln_bias[...]
    want = jax.grad(lambda wi, wo: jnp.sum(lowbit.layernorm_mlp(
        x, scale, ln_bias, (wi, wo), activation_type=("gelu",), quantizer_sets=qs, sr_key=key) ** 2),
        argnums=(0, 1))(model.wi_kernel[...], model.wo_kernel[...])
    for name, w in zip(("wi_kernel", "wo_kernel"), want):
        assert np.abs(np.asarray(w)).max() > 0
        np.testing.assert_array_equal(np.asarray(got[name][...]), np.asarray(w))
