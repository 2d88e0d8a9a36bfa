"""lowbit.recipe and lowbit.autocast: formats, defaults, validation (ValueError naming the
field), hashability (recipes are static config), dtypes per recipe, the active recipe."""

from __future__ import annotations

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit
from lowbit.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

ALL_RECIPES = [
    DelayedScaling(),
    Float8CurrentScaling(),
    MXFP8BlockScaling(),
    Float8BlockScaling(),
    NVFP4BlockScaling(),
]


def test_formats():
    assert (Format.E4M3.max_fwd, Format.E4M3.max_bwd) == (448.0, 448.0)
    assert (Format.E5M2.max_fwd, Format.E5M2.max_bwd) == (57344.0, 57344.0)
    assert (Format.HYBRID.value.max_fwd, Format.HYBRID.value.max_bwd) == (448.0, 57344.0)
    assert Format.E2M1.max_fwd == 6.0
    assert Format.HYBRID.fwd_dtype == jnp.float8_e4m3fn
    assert Format.HYBRID.bwd_dtype == jnp.float8_e5m2
    for fmt in Format:
        assert float(jnp.finfo(fmt.fwd_dtype).max) == fmt.max_fwd
        assert float(jnp.finfo(fmt.bwd_dtype).max) == fmt.max_bwd


def test_defaults():
    r = DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo, r.reduce_amax) == (
        0, Format.HYBRID, 1024, "max", True)
    assert Float8CurrentScaling().fp8_format == Format.HYBRID
    assert not Float8CurrentScaling().use_power_2_scales
    assert MXFP8BlockScaling().fp8_format == Format.E4M3
    b = Float8BlockScaling()
    assert (b.x_block_scaling_dim, b.w_block_scaling_dim, b.grad_block_scaling_dim) == (1, 2, 1)
    assert (b.x_block, b.w_block, b.grad_block) == ((1, 128), (128, 128), (1, 128))
    assert b.use_power_2_scales and not b.use_f32_scales
    assert MXFP8BlockScaling().margin == 0
    whole = DelayedScaling(margin=5.0)  # TE's own tests write a float margin
    assert whole.margin == 5 and type(whole.margin) is int and whole == DelayedScaling(margin=5)
    n = NVFP4BlockScaling()
    assert not (n.disable_rht or n.disable_stochastic_rounding or n.disable_2d_quantization)


@pytest.mark.parametrize(
    "recipe, dtypes",
    [
        (DelayedScaling(), (jnp.float8_e4m3fn, jnp.float8_e5m2)),
        (DelayedScaling(fp8_format=Format.E4M3), (jnp.float8_e4m3fn, jnp.float8_e4m3fn)),
        (Float8CurrentScaling(), (jnp.float8_e4m3fn, jnp.float8_e5m2)),
        (MXFP8BlockScaling(), (jnp.float8_e4m3fn, jnp.float8_e4m3fn)),
        (MXFP8BlockScaling(fp8_format=Format.HYBRID), (jnp.float8_e4m3fn, jnp.float8_e5m2)),
        (Float8BlockScaling(), (jnp.float8_e4m3fn, jnp.float8_e4m3fn)),
        (NVFP4BlockScaling(), (jnp.float4_e2m1fn, jnp.float4_e2m1fn)),
    ],
    ids=repr,
)
def test_dtypes(recipe, dtypes):
    assert (recipe.fwd_dtype, recipe.bwd_dtype) == dtypes


def test_kind_queries():
    assert [r.is_stateful for r in ALL_RECIPES] == [True, False, False, False, False]
    assert DelayedScaling().delayed() and not DelayedScaling().mxfp8()
    assert Float8CurrentScaling().float8_current_scaling()
    assert MXFP8BlockScaling().mxfp8() and Float8BlockScaling().float8_block_scaling()
    assert NVFP4BlockScaling().nvfp4()


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: DelayedScaling(fp8_format=Format.E5M2), "fp8_format"),
        (lambda: DelayedScaling(fp8_format=Format.E2M1), "fp8_format"),
        (lambda: DelayedScaling(fp8_format="hybrid"), "fp8_format"),
        (lambda: DelayedScaling(amax_compute_algo="mean"), "amax_compute_algo"),
        (lambda: DelayedScaling(amax_history_len=0), "amax_history_len"),
        (lambda: DelayedScaling(amax_history_len=2.0), "amax_history_len"),
        (lambda: DelayedScaling(margin=-1), "margin"),
        (lambda: DelayedScaling(margin=0.5), "margin"),
        (lambda: DelayedScaling(margin=128), "margin"),
        (lambda: DelayedScaling(reduce_amax=1), "reduce_amax"),
        (lambda: DelayedScaling(reduce_amax=False), "reduce_amax"),  # not a silent no-op
        (lambda: Float8CurrentScaling(fp8_format=Format.E5M2), "fp8_format"),
        (lambda: Float8CurrentScaling(use_power_2_scales="yes"), "use_power_2_scales"),
        (lambda: MXFP8BlockScaling(fp8_format=Format.E5M2), "fp8_format"),
        (lambda: Float8BlockScaling(fp8_format=Format.E5M2), "fp8_format"),
        (lambda: Float8BlockScaling(x_block_scaling_dim=3), "x_block_scaling_dim"),
        (lambda: Float8BlockScaling(w_block_scaling_dim=0), "w_block_scaling_dim"),
        (lambda: Float8BlockScaling(grad_block_scaling_dim=True), "grad_block_scaling_dim"),
        (lambda: Float8BlockScaling(grad_block_scaling_dim=(1, 128)), "grad_block_scaling_dim"),
        (lambda: Float8BlockScaling(x_block_scaling_dim=1.0), "x_block_scaling_dim"),
        (lambda: Float8BlockScaling(use_f32_scales=1), "use_f32_scales"),
        (lambda: MXFP8BlockScaling(margin=1), "margin"),
        (lambda: MXFP8BlockScaling(margin=0.0), "margin"),
        (lambda: NVFP4BlockScaling(disable_rht=None), "disable_rht"),
        (lambda: NVFP4BlockScaling(disable_2d_quantization=0), "disable_2d_quantization"),
    ],
)
def test_invalid_values_name_the_field(make, field):
    with pytest.raises(ValueError, match=f": {field}: expected"):
        make()


@pytest.mark.parametrize("dims", [(1, 2, 1), (1, 1, 1), (2, 1, 1), (1, 1, 2), (2, 2, 1)])
def test_block_scaling_dims_name_the_tiles(dims):
    # TE's spelling: 1 = 1x128 tiles, 2 = 128x128. (2, 2, 1) is one TE refuses (2-D by 2-D
    # forward GEMM); lowbit takes it and emulates that GEMM (tests/test_dense_block.py).
    x, w, g = dims
    r = Float8BlockScaling(x_block_scaling_dim=x, w_block_scaling_dim=w, grad_block_scaling_dim=g)
    tiles = {1: (1, 128), 2: (128, 128)}
    assert (r.x_block, r.w_block, r.grad_block) == (tiles[x], tiles[w], tiles[g])
    assert r == Float8BlockScaling(**{f"{n}_block_scaling_dim": d for n, d in zip("xw", (x, w))},
                                   grad_block_scaling_dim=g)
    assert hash(r) == hash(dataclasses.replace(r))
    assert dataclasses.replace(r, x_block_scaling_dim=2).x_block == (128, 128)
    assert r == Float8BlockScaling(x_block_scaling_dim=np.int64(x), w_block_scaling_dim=w, grad_block_scaling_dim=g)


def test_te_query_methods_and_qparams():
    from lowbit.recipe import QParams

    assert [r.float8_per_tensor_scaling() for r in ALL_RECIPES] == [True, True, False, False, False]
    assert Float8BlockScaling().fp8_quant_fwd_inp == QParams(power_2_scale=True, amax_epsilon=0.0)
    assert Float8BlockScaling(use_f32_scales=True).fp8_quant_bwd_grad == QParams(power_2_scale=False)
    assert Float8CurrentScaling().fp8_quant_fwd_weight == QParams(power_2_scale=False)
    assert Float8CurrentScaling(use_power_2_scales=True).fp8_quant_fwd_inp.power_2_scale


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=lambda r: type(r).__name__)
def test_frozen_hashable_static(recipe):
    assert hash(recipe) == hash(dataclasses.replace(recipe))
    assert recipe == dataclasses.replace(recipe)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(recipe, "margin", 1)
    traces = []

    def f(x, r):
        traces.append(r)
        return x * 2

    f = jax.jit(f, static_argnums=1)
    f(jnp.ones(2), recipe)
    f(jnp.ones(2), dataclasses.replace(recipe))
    assert len(traces) == 1


def test_delayed_scaling_distinct_configs_differ():
    assert DelayedScaling(margin=1) != DelayedScaling()
    assert hash(DelayedScaling(amax_history_len=16)) != hash(DelayedScaling())


def test_autocast_sets_and_restores_the_recipe():
    assert lowbit.get_global_recipe() is None
    r = Float8CurrentScaling()
    with lowbit.autocast(enabled=True, recipe=r, mesh_resource="mesh"):
        assert lowbit.get_global_recipe() is r
        assert lowbit.quantize.get_global_mesh_resource() == "mesh"
        with lowbit.autocast(enabled=False, recipe=r):
            assert lowbit.get_global_recipe() is None
            assert lowbit.quantize.get_global_mesh_resource() == "mesh"
        with lowbit.autocast(enabled=True):
            assert lowbit.get_global_recipe() == DelayedScaling()
        assert lowbit.get_global_recipe() is r
    assert lowbit.get_global_recipe() is None
    assert lowbit.quantize.get_global_mesh_resource() is None


def test_autocast_restores_after_an_exception():
    with pytest.raises(RuntimeError):
        with lowbit.autocast(enabled=True, recipe=DelayedScaling()):
            raise RuntimeError("boom")
    assert lowbit.get_global_recipe() is None


def test_autocast_is_per_thread():
    seen = []
    with lowbit.autocast(enabled=True, recipe=DelayedScaling()):
        thread = threading.Thread(target=lambda: seen.append(lowbit.get_global_recipe()))
        thread.start()
        thread.join()
    assert seen == [None]


def test_autocast_rejects_a_non_recipe():
    with pytest.raises(TypeError, match="recipe"):
        with lowbit.autocast(enabled=True, recipe="delayed"):
            pass


def test_fp8_autocast_takes_te_keyword():
    """TE's older spelling, `fp8_autocast(enabled=..., fp8_recipe=...)`, ports unchanged."""
    recipe = Float8CurrentScaling()
    with lowbit.fp8_autocast(enabled=True, fp8_recipe=recipe):
        assert lowbit.get_global_recipe() is recipe
    assert lowbit.get_global_recipe() is None
    with lowbit.fp8_autocast(enabled=True):
        assert lowbit.get_global_recipe() == DelayedScaling()
    with pytest.raises(TypeError, match="fp8_autocast: fp8_recipe"):
        with lowbit.fp8_autocast(enabled=True, fp8_recipe="delayed"):
            pass


@pytest.mark.parametrize("cls", [DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling,
                                 Float8BlockScaling, NVFP4BlockScaling])
def test_te_attention_fields_accepted_false_only(cls):
    """fp8_dpa / fp8_mha: TE's fields, accepted as False (lowbit has no FP8 attention)."""
    assert cls(fp8_dpa=False, fp8_mha=False) == cls()
    for field in ("fp8_dpa", "fp8_mha"):
        with pytest.raises(ValueError, match=f"{cls.__name__}: {field}: expected False"):
            cls(**{field: True})


def test_delayed_scaling_factor_compute_algo_none_only():
    assert DelayedScaling(scaling_factor_compute_algo=None) == DelayedScaling()
    with pytest.raises(ValueError, match="scaling_factor_compute_algo: expected None"):
        DelayedScaling(scaling_factor_compute_algo=lambda amax, scale, fp8_max, recipe: scale)
