"""The Linen modules' initializer fields, resolved in __post_init__ as TE's modules do:
kernel_init None -> TE's variance_scaling(1.0, "fan_in", "truncated_normal", dtype=dtype),
scale_init None -> ones (zeros with zero_centered_gamma); given initializers are kept.

Reference: TE's default written out in jnp (flax's variance_scaling: a truncated normal on
[-2, 2] times sqrt(1 / fan_in) / 0.87962566103423978, the stddev of that truncated normal),
and a plain Linen module creating TE's parameters in TE's order with TE's initializers, so
that one seed gives TE's initial weights (LayerNormMLP's wi_kernel from TE's key chain).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from lowbit.flax.module import DenseGeneral, LayerNorm, LayerNormDenseGeneral, LayerNormMLP

H, F = 32, 64
KERNEL_MODULES = {"DenseGeneral": lambda **kw: DenseGeneral(16, **kw),
                  "LayerNormDenseGeneral": lambda **kw: LayerNormDenseGeneral(16, **kw),
                  "LayerNormMLP": lambda **kw: LayerNormMLP(F, **kw)}
SCALE_MODULES = {"LayerNorm": lambda **kw: LayerNorm(**kw),
                 "LayerNormDenseGeneral": KERNEL_MODULES["LayerNormDenseGeneral"],
                 "LayerNormMLP": KERNEL_MODULES["LayerNormMLP"]}


def te_default_kernel(key, shape, dtype):
    """TE's default kernel init, (fan_in, fan_out) kernels: fan_in = shape[0]; the stddev is
    rounded to dtype before the product (a weakly typed sqrt over a dtype array), as flax does."""
    stddev = jnp.sqrt(1.0 / shape[0]) / jnp.array(0.87962566103423978, dtype)
    return jax.random.truncated_normal(key, -2, 2, shape, dtype) * stddev


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", list(KERNEL_MODULES))
def test_kernel_init_resolved_at_construction(name, dtype):
    module = KERNEL_MODULES[name](dtype=dtype)
    assert callable(module.kernel_init)
    key = jax.random.PRNGKey(5)
    got = module.kernel_init(key, (48, 24))  # the module's dtype is the initializer's default
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(te_default_kernel(key, (48, 24), dtype), np.float32))
    mine = nn.initializers.normal(0.3)
    assert KERNEL_MODULES[name](kernel_init=mine).kernel_init is mine
    assert module.clone().kernel_init is module.kernel_init


@pytest.mark.parametrize("name", list(SCALE_MODULES))
def test_scale_init_resolved_at_construction(name):
    assert SCALE_MODULES[name]().scale_init is nn.initializers.ones
    assert SCALE_MODULES[name](zero_centered_gamma=True).scale_init is nn.initializers.zeros
    mine = nn.initializers.normal(0.3)
    assert SCALE_MODULES[name](scale_init=mine, zero_centered_gamma=True).scale_init is mine


def _te_kernel_init(dtype):
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", dtype=dtype)


class TEParams(nn.Module):
    """TE's parameter creation for one module kind, in TE's order, with TE's defaults."""

    kind: str

    @nn.compact
    def __call__(self, x):
        init = _te_kernel_init(jnp.float32)
        if self.kind != "DenseGeneral":
            self.param("scale", nn.initializers.ones, (H,), jnp.float32)
            self.param("ln_bias", nn.initializers.zeros, (H,), jnp.float32)
        if self.kind == "LayerNormMLP":
            def kernel_1_init(key, num_kernels, stack_axis, *init_args):  # TE's key chain
                kernels = []
                for _ in range(num_kernels):
                    key, init_key = jax.random.split(key)
                    kernels.append(init(init_key, *init_args))
                return jnp.stack(kernels, axis=stack_axis)

            self.param("wi_kernel", kernel_1_init, 2, -2, (H, F), jnp.float32)
            self.param("wo_kernel", init, (F, H), jnp.float32)
            return
        self.param("kernel", init, (H, 16), jnp.float32)
        if self.kind == "DenseGeneral":
            self.param("bias", nn.initializers.zeros, (16,), jnp.float32)


@pytest.mark.parametrize("name", list(KERNEL_MODULES))
def test_initial_weights_are_tes(name):
    x = jnp.ones((2, 4, H), jnp.float32)
    module = KERNEL_MODULES[name](**({"activations": ("gelu", "linear")} if name == "LayerNormMLP" else {}))
    kw = {"deterministic": True} if name == "LayerNormMLP" else {}
    got = nn.meta.unbox(module.init(jax.random.PRNGKey(7), x, **kw))["params"]
    want = TEParams(name).init(jax.random.PRNGKey(7), x)["params"]
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
