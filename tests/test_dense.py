"""lowbit.dense and lowbit.flax.make_dot_general_cls against jnp references.

The reference quantizes exactly as DESIGN §4 says (q = fp8(clip(x*scale)), x ~ q/scale),
multiplies the dequantized operands in fp32 and adds the bias. lowbit's CPU GEMM also
accumulates in fp32, in another order: relative differences stay below 1e-5 of the output
scale. Against the unquantized model the error is FP8's (E4M3 rounding, 2^-4 relative per
operand): we allow 8% of the output's RMS.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import lowbit
from lowbit.dense import dense
from lowbit.quantize import QuantizerFactory
from lowbit.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling


def q_ref(x, scale, dtype):
    mx = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) * scale, -mx, mx).astype(dtype).astype(jnp.float32) * (1.0 / scale)


def current_scale(x, dtype):
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    return jnp.where(amax > 0, float(jnp.finfo(dtype).max) / amax, 1.0)


def dense_ref(x, k, b, dtype=jnp.float8_e4m3fn):
    xd = q_ref(x, current_scale(x, dtype), dtype)
    kd = q_ref(k, current_scale(k, dtype), dtype)
    y = jnp.dot(xd, kd, precision=jax.lax.Precision.HIGHEST)
    return y if b is None else y + b.astype(jnp.float32)


# lowbit's CPU GEMM accumulates in fp32; on Hopper the forward GEMM uses the fast FP8
# accumulation (measured 8e-5 relative on an H100) and the backward ones the split one.
GEMM_TOL = 1e-5 if jax.default_backend() == "cpu" else 5e-4


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("use_bias", [False, True])
def test_current_scaling_forward_matches_reference(dtype, use_bias, rng):
    x = jnp.asarray(rng.standard_normal((3, 16, 64)), dtype)
    k = jnp.asarray(rng.standard_normal((64, 48)) * 0.1, dtype)
    b = jnp.asarray(rng.standard_normal(48), dtype) if use_bias else None
    qs = QuantizerFactory.create_set(Float8CurrentScaling())
    y = jax.jit(lambda x, k, b: dense(x, k, b, contracting_dims=((2,), (0,)), quantizer_set=qs))(x, k, b)
    assert y.shape == (3, 16, 48) and y.dtype == dtype
    ref = dense_ref(x.reshape(-1, 64), k, b).reshape(3, 16, 48)
    tol = GEMM_TOL if dtype == jnp.float32 else 1e-2  # bf16 output rounding
    assert rel_err(y, ref) < tol
    exact = jnp.einsum("bsk,kn->bsn", x.astype(jnp.float32), k.astype(jnp.float32))
    if b is not None:
        exact = exact + b.astype(jnp.float32)
    assert rel_err(y, exact) < 0.08


def test_gradients_match_quantized_reference(rng):
    """dx = dy_q . k_q^T and dw = x_q^T . dy_q with E5M2 gradients (HYBRID)."""
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((64, 16)) * 0.1, jnp.float32)
    b = jnp.asarray(rng.standard_normal(16), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
    qs = QuantizerFactory.create_set(Float8CurrentScaling())
    _, vjp = jax.vjp(lambda x, k, b: dense(x, k, b, quantizer_set=qs), x, k, b)
    dx, dk, db = vjp(dy)
    e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
    xd, kd = q_ref(x, current_scale(x, e4), e4), q_ref(k, current_scale(k, e4), e4)
    dyd = q_ref(dy, current_scale(dy, e5), e5)
    hi = jax.lax.Precision.HIGHEST
    assert rel_err(dx, jnp.dot(dyd, kd.T, precision=hi)) < GEMM_TOL
    assert rel_err(dk, jnp.dot(xd.T, dyd, precision=hi)) < GEMM_TOL
    np.testing.assert_allclose(np.asarray(db), np.asarray(dy.sum(0)), rtol=1e-5, atol=1e-5)


def test_delayed_scaling_state_is_returned_as_gradient(rng):
    recipe = DelayedScaling(amax_history_len=4)
    qs = QuantizerFactory.create_set(recipe)
    x = jnp.asarray(rng.standard_normal((16, 32)) * 3, jnp.float32)
    k = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((16, 16)) * 5, jnp.float32)
    _, vjp = jax.vjp(lambda k, q: dense(x, k, quantizer_set=q), k, qs)
    _, new_qs = vjp(dy)
    amax_x = float(jnp.max(jnp.abs(x)))
    assert float(new_qs.x.amax_history[-1]) == amax_x or float(jnp.max(new_qs.x.amax_history)) == amax_x
    np.testing.assert_allclose(float(new_qs.x.scale[0]), 448.0 / amax_x, rtol=1e-6)
    np.testing.assert_allclose(float(new_qs.dgrad.scale[0]), 57344.0 / float(jnp.max(jnp.abs(dy))), rtol=1e-6)


def test_no_recipe_is_plain_dot(rng):
    x = jnp.asarray(rng.standard_normal((5, 7)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((7, 3)), jnp.float32)
    np.testing.assert_allclose(np.asarray(dense(x, k)), np.asarray(x @ k), rtol=1e-6)


def test_multiple_contracting_dims_and_errors(rng):
    x = jnp.asarray(rng.standard_normal((4, 6, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((6, 8, 5)), jnp.float32)
    qs = QuantizerFactory.create_set(Float8CurrentScaling())
    y = dense(x, k, contracting_dims=((1, 2), (0, 1)), quantizer_set=qs)
    ref = dense_ref(x.reshape(4, 48), k.reshape(48, 5), None)
    assert rel_err(y, ref) < GEMM_TOL
    with pytest.raises(ValueError, match="lowbit.dense: contracting_dims"):
        dense(x, k, contracting_dims=((1,), (1,)), quantizer_set=qs)
    with pytest.raises(ValueError, match="lowbit.dense: bias"):
        dense(x, k, jnp.zeros(7), contracting_dims=((1, 2), (0, 1)), quantizer_set=qs)
    with pytest.raises(ValueError, match="lowbit.dense: contracting_dims: expected"):
        dense(x, k, contracting_dims=(1, 0), quantizer_set=qs)
    with pytest.raises(TypeError, match="lowbit.dense: quantizer_set: expected a lowbit QuantizerSet"):
        dense(x, k, contracting_dims=((1, 2), (0, 1)), quantizer_set="fp8")
    # A list bias is taken as an array.
    y_list = dense(x, k, [0.5] * 5, contracting_dims=((1, 2), (0, 1)), quantizer_set=qs)
    np.testing.assert_array_equal(y_list, dense(x, k, jnp.full((5,), 0.5), contracting_dims=((1, 2), (0, 1)),
                                                quantizer_set=qs))
    # Quantized, both operands need a free dim (unquantized, a kernel without one is a dot).
    with pytest.raises(ValueError, match="lowbit.dense: kernel: a quantized dense needs a free"):
        dense(x[0], k[0, :, 0], contracting_dims=((1,), (0,)), quantizer_set=qs)
    assert dense(x[0], k[0, :, 0], contracting_dims=((1,), (0,))).shape == (6,)
    # A set mixing per-tensor and block quantizers fits no GEMM: refused by dense itself.
    block = QuantizerFactory.create_set(MXFP8BlockScaling())
    with pytest.raises(ValueError, match="lowbit.dense: quantizer_set: the three quantizers must share a scaling"):
        dense(x, k, contracting_dims=((1, 2), (0, 1)), quantizer_set=qs._replace(kernel=block.kernel))
    fp8_block = QuantizerFactory.create_set(Float8BlockScaling())
    with pytest.raises(ValueError, match="MXFP8_1D_SCALING, FP8_BLOCK"):
        dense(x, k, contracting_dims=((1, 2), (0, 1)), quantizer_set=block._replace(kernel=fp8_block.kernel))


class DenseBlock(nn.Module):
    dot_general_cls: callable = lambda: None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32, dot_general=self.dot_general_cls())(x)
        return nn.Dense(16, dot_general=self.dot_general_cls())(nn.gelu(x))


def test_make_dot_general_cls_state_layout():
    cls = lowbit.flax.make_dot_general_cls(DelayedScaling(amax_history_len=16))
    x = jnp.ones((2, 8, 24), jnp.bfloat16)
    variables = DenseBlock(cls).init(jax.random.key(0), x)
    state = variables[lowbit.flax.OVERWRITE_WITH_GRADIENT]
    assert set(state) == {"TEWrapper_dot_general_0", "TEWrapper_dot_general_1"}
    shapes = jax.tree.map(lambda v: v.shape, state["TEWrapper_dot_general_0"])
    assert shapes == {"x_scale": (1,), "x_amax_history": (16,), "kernel_scale": (1,),
                      "kernel_amax_history": (16,), "grad_scale": (1,), "grad_amax_history": (16,)}
    stateless = DenseBlock(lowbit.flax.make_dot_general_cls(Float8CurrentScaling())).init(jax.random.key(0), x)
    assert set(stateless) == {"params"}


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=8), Float8CurrentScaling()], ids=type)
def test_flax_training_steps(recipe, rng):
    """A few SGD steps through nn.Dense(dot_general=cls()): close to the bf16 model, and the
    delayed-scaling state changes from step to step."""
    cls = lowbit.flax.make_dot_general_cls(recipe)
    x = jnp.asarray(rng.standard_normal((4, 8, 24)), jnp.float32)
    target = jnp.asarray(rng.standard_normal((4, 8, 16)), jnp.float32)
    base, quant = DenseBlock(), DenseBlock(cls)
    variables = quant.init(jax.random.key(1), x)
    params = variables["params"]

    def loss(model, variables, x):
        return jnp.mean((model.apply(variables, x) - target) ** 2)

    @jax.jit
    def step(variables):
        grads = jax.grad(lambda v: loss(quant, v, x))(variables)
        new = {"params": jax.tree.map(lambda p, g: p - 0.05 * g, variables["params"], grads["params"])}
        if lowbit.flax.OVERWRITE_WITH_GRADIENT in variables:
            new[lowbit.flax.OVERWRITE_WITH_GRADIENT] = grads[lowbit.flax.OVERWRITE_WITH_GRADIENT]
        return new

    y_base = base.apply({"params": params}, x)
    y_quant = quant.apply(variables, x)
    if isinstance(recipe, Float8CurrentScaling):
        assert rel_err(y_quant, y_base) < 0.08
    states = []
    for _ in range(3):
        variables = step(variables)
        states.append(variables.get(lowbit.flax.OVERWRITE_WITH_GRADIENT))
    if isinstance(recipe, DelayedScaling):
        s1 = states[0]["TEWrapper_dot_general_0"]
        s2 = states[1]["TEWrapper_dot_general_0"]
        assert float(s1["x_scale"][0]) != 1.0  # the first step's scale came from its amax
        assert not np.array_equal(np.asarray(s1["x_amax_history"]), np.asarray(s2["x_amax_history"]))
        y_quant = quant.apply(variables, x)
        y_base = base.apply({"params": variables["params"]}, x)
        assert rel_err(y_quant, y_base) < 0.08
    assert float(loss(quant, variables, x)) < float(loss(base, {"params": params}, x))


def count_primitive(jaxpr, name: str) -> int:
    """Equations of primitive `name` in a jaxpr, sub-jaxprs (custom_partitioning, remat,
    pjit, custom_vjp) included."""
    from jax.extend import core as jcore

    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, jcore.ClosedJaxpr):
                    n += count_primitive(sub.jaxpr, name)
                elif isinstance(sub, jcore.Jaxpr):
                    n += count_primitive(sub, name)
    return n


def test_checkpoint_policy_saves_lowbit_gemms(rng):
    """Under jax.checkpoint with lowbit's policy the backward program holds only the 4
    backward GEMMs of two dense layers (6 in all); JAX's nothing_saveable recomputes the two
    forward GEMMs there (8)."""
    qs = QuantizerFactory.create_set(Float8CurrentScaling())
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    k1 = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    k2 = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)

    def f(k1, k2):
        return jnp.sum(jnp.sin(dense(jnp.tanh(dense(x, k1, quantizer_set=qs)), k2, quantizer_set=qs)))

    def gemm_count(policy):
        g = jax.grad(jax.checkpoint(f, policy=policy), argnums=(0, 1))
        return count_primitive(jax.make_jaxpr(g)(k1, k2).jaxpr, "lowbit_gemm")

    assert gemm_count(lowbit.checkpoint_policies.checkpoint_dots_and_lowbit_gemms) == 6
    assert gemm_count(jax.checkpoint_policies.checkpoint_dots) == 8
    assert gemm_count(jax.checkpoint_policies.nothing_saveable) == 8
