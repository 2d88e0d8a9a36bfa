"""The recipe's per-GEMM accumulation (lowbit.recipe.MMParams: fp8_gemm_fprop, fp8_gemm_dgrad,
fp8_gemm_wgrad) reaching every FP8 GEMM of a layer as lowbit_gemm's use_split_accumulator and
lowbit_dense_backward_fp8's dgrad_split / wgrad_split, through the quantizer set's
GemmAccumulation, from each entry point: lowbit.dense (fused, unfused and sharded backward),
layernorm_dense, layernorm_mlp, the Flax and NNX modules and make_dot_general_cls.

What is checked is the lowered program (the attributes the handlers get); the GPU test checks
that the fused backward with fast accumulation gives the unfused ops' values. On the CPU the
GEMM reference has one accumulation, so the values do not depend on the choice (checked too).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

from conftest import rel_err, run_on

import lowbit
from lowbit.dense import DENSE_BACKWARD_ENV
from lowbit.flax import nnx as lowbit_nnx
from lowbit.layernorm_dense import layernorm_dense
from lowbit.layernorm_mlp import layernorm_mlp
from lowbit.quantize import GemmAccumulation, QuantizerFactory
from lowbit.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MMParams

FAST, SPLIT = MMParams(use_split_accumulator=False), MMParams(use_split_accumulator=True)
# Every GEMM the opposite of TE's default (fast forward, split backward).
FLIPPED = dict(fp8_gemm_fprop=SPLIT, fp8_gemm_dgrad=FAST, fp8_gemm_wgrad=FAST)
RECIPES = [DelayedScaling(amax_history_len=4, **FLIPPED), Float8CurrentScaling(**FLIPPED)]
RECIPE_IDS = ["delayed", "current"]


def with_defaults(recipe):
    """The recipe with TE's default accumulation (fast forward, split backward)."""
    return dataclasses.replace(recipe, fp8_gemm_fprop=FAST, fp8_gemm_dgrad=SPLIT, fp8_gemm_wgrad=SPLIT)


def gemm_splits(text: str) -> list[bool]:
    """use_split_accumulator of each lowbit_gemm custom call in a lowered program, in order."""
    return [m == "true" for m in re.findall(r"@lowbit_gemm\(.*?use_split_accumulator = (true|false)", text)]


def fused_splits(text: str) -> list[tuple[bool, bool]]:
    """(dgrad_split, wgrad_split) of each lowbit_dense_backward_fp8 custom call."""
    calls = re.findall(r"@lowbit_dense_backward_fp8\(.*", text)
    out = []
    for call in calls:
        d = re.search(r"dgrad_split = (true|false)", call).group(1)
        w = re.search(r"wgrad_split = (true|false)", call).group(1)
        out.append((d == "true", w == "true"))
    return out


def test_recipe_defaults_and_validation():
    for recipe in (DelayedScaling(), Float8CurrentScaling()):
        assert recipe.fp8_gemm_fprop == FAST and recipe.fp8_gemm_dgrad == SPLIT and recipe.fp8_gemm_wgrad == SPLIT
        assert QuantizerFactory.create_set(recipe).accumulation == GemmAccumulation(False, True, True)
    assert hash(DelayedScaling(**FLIPPED)) != hash(DelayedScaling())  # a jit static argument
    with pytest.raises(ValueError, match="MMParams: use_split_accumulator: expected a bool"):
        MMParams(use_split_accumulator=1)
    with pytest.raises(ValueError, match="DelayedScaling: fp8_gemm_dgrad: expected a lowbit.recipe.MMParams"):
        DelayedScaling(fp8_gemm_dgrad=False)
    with pytest.raises(ValueError, match="Float8CurrentScaling: fp8_gemm_wgrad: expected a lowbit.recipe.MMParams"):
        Float8CurrentScaling(fp8_gemm_wgrad={"use_split_accumulator": False})
    with pytest.raises(ValueError, match="GemmAccumulation: dgrad: expected a bool"):
        GemmAccumulation(dgrad=None)
    # Float8BlockScaling takes TE's fields too, split only (its GEMMs have no fast accumulation).
    assert Float8BlockScaling(fp8_gemm_fprop=SPLIT).fp8_gemm_fprop == SPLIT
    with pytest.raises(ValueError,
                       match=r"Float8BlockScaling: fp8_gemm_fprop: expected MMParams\(use_split_accumulator=True\)"):
        Float8BlockScaling(fp8_gemm_fprop=FAST)


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_factory_sets_carry_the_recipes_choice(recipe):
    qs = QuantizerFactory.create_set(recipe)
    assert qs.accumulation == GemmAccumulation(fprop=True, dgrad=False, wgrad=False)
    assert len(qs.quantizers) == 3 and all(q is not None for q in qs.quantizers)
    # The block recipes' GEMMs have one accumulation: their sets keep the default.
    assert QuantizerFactory.create_set(Float8BlockScaling()).accumulation == GemmAccumulation()


def _dense_step(x, kernel, bias, qs, dy):
    y, vjp = jax.vjp(lambda x, k, b, q: lowbit.dense(x, k, b, quantizer_set=q), x, kernel, bias, qs)
    return (y, *vjp(dy))


def _dense_inputs(rng, m=512, k=512, n=1024):
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    kernel = jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(n), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    return x, kernel, bias, dy


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_dense_gemms_take_the_sets_accumulation(monkeypatch, rng, recipe, mode):
    """Forward GEMM split, dgrad and wgrad fast: as attributes of the unfused lowbit_gemm calls,
    or of the fused backward op (which resolves its cuBLASLt indices for that accumulation)."""
    monkeypatch.setenv(DENSE_BACKWARD_ENV, mode)
    x, kernel, bias, dy = _dense_inputs(rng)
    # A fresh function per trace: the backward mode is read when tracing.
    text = jax.jit(lambda *a: _dense_step(*a)).lower(x, kernel, bias, QuantizerFactory.create_set(recipe), dy).as_text()
    if mode == "fused":
        assert gemm_splits(text) == [True] and fused_splits(text) == [(False, False)], text[-3000:]
    else:
        assert gemm_splits(text) == [True, False, False] and fused_splits(text) == [], text[-3000:]
    # The default set: fast forward, split backward.
    default = jax.jit(lambda *a: _dense_step(*a)).lower(
        x, kernel, bias, QuantizerFactory.create_set(with_defaults(recipe)), dy).as_text()
    if mode == "fused":
        assert gemm_splits(default) == [False] and fused_splits(default) == [(True, True)]
    else:
        assert gemm_splits(default) == [False, True, True]


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_state_gradient_keeps_the_accumulation_and_cpu_values_do_not_change(rng, recipe):
    """The quantizer set's gradient (the updated state) keeps its accumulation; on the CPU the
    reference GEMM has one accumulation, so the flipped recipe gives the default's values."""
    x, kernel, bias, dy = _dense_inputs(rng)
    flipped = jax.jit(_dense_step)(x, kernel, bias, QuantizerFactory.create_set(recipe), dy)
    assert flipped[4].accumulation == GemmAccumulation(fprop=True, dgrad=False, wgrad=False)
    if jax.default_backend() == "cpu":
        default = jax.jit(_dense_step)(x, kernel, bias, QuantizerFactory.create_set(with_defaults(recipe)), dy)
        for a, b in zip(jax.tree.leaves(flipped), jax.tree.leaves(default)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_layernorm_dense_and_mlp_take_the_accumulation(rng, recipe):
    x = jnp.asarray(rng.standard_normal((2, 64, 128)), jnp.bfloat16)
    gamma, beta = jnp.ones((128,), jnp.float32), jnp.zeros((128,), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((128, 256)) * 0.05, jnp.float32)
    qs = QuantizerFactory.create_set(recipe)

    def ln_dense(x, k, q):
        return jax.value_and_grad(
            lambda x, k: layernorm_dense(x, k, gamma, beta, quantizer_set=q).astype(jnp.float32).sum(),
            argnums=(0, 1))(x, k)

    # forward split; dgrad and wgrad fast (both unfused: layernorm_dense has no fused backward)
    assert sorted(gemm_splits(jax.jit(ln_dense).lower(x, kernel, qs).as_text())) == [False, False, True]

    wi = jnp.asarray(rng.standard_normal((128, 256)) * 0.05, jnp.float32)
    wo = jnp.asarray(rng.standard_normal((256, 128)) * 0.05, jnp.float32)
    qs1 = QuantizerFactory.create_set(recipe)
    qs2 = QuantizerFactory.create_set(with_defaults(recipe))  # the second GEMM's set: the defaults

    def mlp(x, wi, wo):
        return jax.value_and_grad(
            lambda x, wi, wo: layernorm_mlp(x, gamma, beta, (wi, wo), quantizer_sets=(qs1, qs2),
                                            activation_type=("gelu",)).astype(jnp.float32).sum(),
            argnums=(0, 1, 2))(x, wi, wo)

    # six GEMMs: the first set's (split, fast, fast) and the second's (fast, split, split)
    assert sorted(gemm_splits(jax.jit(mlp).lower(x, wi, wo).as_text())) == [False] * 3 + [True] * 3


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_modules_take_the_accumulation(monkeypatch, rng, recipe):
    """Linen DenseGeneral, make_dot_general_cls in Flax's Dense and NNX DenseGeneral: the
    recipe's choice reaches the lowered GEMMs (unfused backward, so that each GEMM is a call)."""
    monkeypatch.setenv(DENSE_BACKWARD_ENV, "unfused")
    x = jnp.asarray(rng.standard_normal((4, 32, 128)), jnp.bfloat16)

    def splits(apply, variables):
        def loss(v, x):
            return apply(v, x).astype(jnp.float32).sum()
        return gemm_splits(jax.jit(jax.value_and_grad(loss)).lower(variables, x).as_text())

    linen = lowbit.flax.DenseGeneral(256, quantization_recipe=recipe)
    v = linen.init(jax.random.PRNGKey(0), x)
    assert splits(linen.apply, v) == [True, False, False]

    drop_in = nn.Dense(256, dtype=jnp.bfloat16, dot_general_cls=lowbit.flax.make_dot_general_cls(recipe))
    v = drop_in.init(jax.random.PRNGKey(0), x)
    assert splits(drop_in.apply, v) == [True, False, False]

    module = lowbit_nnx.DenseGeneral(128, 256, quantization_recipe=recipe, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(module)
    assert splits(lambda s, x: nnx.merge(graphdef, s)(x), state) == [True, False, False]


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_cuda_fused_fast_backward_matches_unfused(monkeypatch, rng, gpu, recipe):
    """On the GPU, the fused backward with fast dgrad and wgrad gives the unfused fast GEMMs'
    values (the same cuBLASLt kernels: batched and sliced launches, hence a tolerance), and
    both stay near the split-accumulation result (fast accumulation: a few e-3 at most)."""
    x, kernel, bias, dy = _dense_inputs(rng)
    outs = {}
    for mode in ("fused", "unfused"):
        monkeypatch.setenv(DENSE_BACKWARD_ENV, mode)
        outs[mode] = run_on(gpu, lambda *a: _dense_step(*a), x, kernel, bias, QuantizerFactory.create_set(recipe), dy)
    outs["split"] = run_on(gpu, lambda *a: _dense_step(*a), x, kernel, bias,
                           QuantizerFactory.create_set(with_defaults(recipe)), dy)
    (_, dx, dk, db, _), (_, dx_u, dk_u, db_u, _) = outs["fused"], outs["unfused"]
    assert rel_err(dx, dx_u) < 4e-3 and rel_err(dk, dk_u) < 5e-4  # dx in bf16: its rounding too
    np.testing.assert_array_equal(np.asarray(db), np.asarray(db_u))
    _, dx_s, dk_s, _, _ = outs["split"]
    assert rel_err(dx, dx_s) < 1e-2 and rel_err(dk, dk_s) < 1e-2


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_sharded_fused_backward_takes_the_accumulation(monkeypatch, rng, recipe):
    """Under a MeshResource with a tp axis (dense_backward_fp8_sharded, partitioned per
    device): the per-device ops of the compiled program carry the set's accumulation."""
    if jax.default_backend() != "cpu":
        pytest.skip("virtual CPU devices")
    from jax.sharding import NamedSharding, PartitionSpec as P

    from lowbit.sharding import MeshResource, global_shard_guard

    mesh = jax.make_mesh((2, 2), ("dp", "tp"), devices=jax.devices("cpu")[:4])
    x = jnp.asarray(rng.standard_normal((2, 256, 256)), jnp.bfloat16)
    kernel = jnp.asarray(rng.standard_normal((256, 1024)) * 0.05, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(1024), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((2, 256, 1024)), jnp.bfloat16)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    args = (put(x, P("dp")), put(kernel, P(None, "tp")), put(bias, P()), QuantizerFactory.create_set(recipe),
            put(dy, P("dp", None, "tp")))
    monkeypatch.setenv(DENSE_BACKWARD_ENV, "fused")
    with global_shard_guard(MeshResource(dp_resource="dp", tp_resource="tp")):
        hlo = jax.jit(lambda *a: _dense_step(*a)).lower(*args).compile().as_text()
    calls = [line for line in hlo.splitlines() if 'custom_call_target="lowbit_dense_backward_fp8"' in line]
    assert calls, hlo[-3000:]
    for call in calls:
        assert re.search(r"dgrad_split\s*=\s*false", call) and re.search(r"wgrad_split\s*=\s*false", call), call
